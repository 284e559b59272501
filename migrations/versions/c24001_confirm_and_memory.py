"""sweeps.confirm (the latest confirm run asked: api/engine/_confirm.py) and trial_memory (each real
trial's memory timeline per rank, apart from the trials table: api/store/_timeline.py)

Revision ID: c24001
Revises: d210001
Create Date: 2026-12-01 21:00:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = 'c24001'
down_revision = 'd210001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.add_column(sa.Column('confirm', sa.JSON(), nullable=True))
    op.create_table('trial_memory',
    sa.Column('trial_id', sa.Integer(), nullable=False),
    sa.Column('ranks', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['trial_id'], ['trials.id'], name=op.f('fk_trial_memory_trial_id_trials'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('trial_id', name=op.f('pk_trial_memory'))
    )


def downgrade() -> None:
    op.drop_table('trial_memory')
    # A plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35, PostgreSQL), not a batch copy of the table:
    # re-creating "sweeps" drops the old one, which with SQLite's foreign keys on cascades to every
    # trial (ON DELETE CASCADE) and would empty the store.
    op.drop_column('sweeps', 'confirm')
