"""device_leases: the devices each coordinator on this database holds, one row per granted trial, so
coordinators sharing one cluster count each other's devices (api/store/_leases.py)

Revision ID: u0001
Revises: p0001
Create Date: 2026-12-01 16:20:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = 'u0001'
down_revision = 'p0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('device_leases',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('pool', sa.String(length=200), nullable=False),
    sa.Column('sweep_id', sa.Integer(), nullable=False),
    sa.Column('owner', sa.String(length=200), nullable=True),
    sa.Column('devices', sa.Integer(), nullable=False),
    sa.Column('holder', sa.String(length=200), nullable=False),
    sa.Column('granted_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_device_leases'))
    )
    with op.batch_alter_table('device_leases', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_device_leases_pool_heartbeat_at'), ['pool', 'heartbeat_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('device_leases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_device_leases_pool_heartbeat_at'))
    op.drop_table('device_leases')
