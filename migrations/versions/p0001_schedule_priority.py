"""schedules.priority: the queue priority (high, normal, low) of the sweeps a schedule fires, so a
nightly schedule can yield to interactive sweeps or go ahead of them

Revision ID: p0001
Revises: n0001
Create Date: 2026-12-01 15:00:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = 'p0001'
down_revision = 'n0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        # Existing schedules keep firing "normal" sweeps, what every fire queued before this column.
        batch_op.add_column(sa.Column('priority', sa.String(length=8), nullable=False, server_default='normal'))


def downgrade() -> None:
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        batch_op.drop_column('priority')
