"""sweeps.fingerprint (the cluster a sweep measured, for learning across sweeps) and
trials.calibration_version (the calibration a trial's predictions were made under)

Revision ID: t0001
Revises: r0001
Create Date: 2026-12-02 10:00:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = 't0001'
down_revision = 'r0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.add_column(sa.Column('fingerprint', sa.String(length=64), nullable=True))
        batch_op.create_index(batch_op.f('ix_sweeps_fingerprint_status'), ['fingerprint', 'status'], unique=False)
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.add_column(sa.Column('calibration_version', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.drop_column('calibration_version')
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sweeps_fingerprint_status'))
        batch_op.drop_column('fingerprint')
