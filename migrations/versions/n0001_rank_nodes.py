"""trials.rank_nodes: the node each rank's process ran on (where the placement landed), as the
Ray backend records it

Revision ID: n0001
Revises: k0001
Create Date: 2026-12-01 12:30:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = 'n0001'
down_revision = 'k0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.add_column(sa.Column('rank_nodes', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.drop_column('rank_nodes')
