"""sweeps.stop_reason: why a sweep ended, one line (max_trials, device budget, patience, every layout
tried, nothing left predicted to fit, cancelled, failed)

Revision ID: s20_0001
Revises: r27_0001
Create Date: 2026-12-02 01:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = 's20_0001'
down_revision = 'r27_0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.add_column(sa.Column('stop_reason', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.drop_column('stop_reason')
