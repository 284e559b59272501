"""sweeps.priority: the queue's priority of a sweep (high, normal, low), for sharing one cluster
between sweeps and owners

Revision ID: q0001
Revises: t0001
Create Date: 2026-12-01 11:30:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = 'q0001'
down_revision = 't0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        # Existing sweeps (and scheduled ones, which name none) queue as "normal".
        batch_op.add_column(sa.Column('priority', sa.String(length=8), nullable=False, server_default='normal'))


def downgrade() -> None:
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.drop_column('priority')
