"""The coordinators' one device queue per cluster: cluster_members (each coordinator on a cluster, its
beat and the devices it sees), device_waiters (every sweep waiting for devices), and device_leases kept
as the grants' history (released_at, release_cause; a lease lives with its holder's member row, so its
own heartbeat goes) (api/store/_leases.py)

Revision ID: q25001
Revises: c24001
Create Date: 2026-12-02 09:00:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = 'q25001'
down_revision = 'c24001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('cluster_members',
    sa.Column('pool', sa.String(length=200), nullable=False),
    sa.Column('holder', sa.String(length=200), nullable=False),
    sa.Column('capacity', sa.Integer(), nullable=False),
    sa.Column('joined_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('pool', 'holder', name=op.f('pk_cluster_members'))
    )
    op.create_table('device_waiters',
    sa.Column('pool', sa.String(length=200), nullable=False),
    sa.Column('sweep_id', sa.Integer(), nullable=False),
    sa.Column('holder', sa.String(length=200), nullable=False),
    sa.Column('owner', sa.String(length=200), nullable=True),
    sa.Column('priority', sa.String(length=8), nullable=False),
    sa.Column('devices', sa.Integer(), nullable=False),
    sa.Column('owner_max', sa.Float(), nullable=True),
    sa.Column('since', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('pool', 'sweep_id', name=op.f('pk_device_waiters'))
    )
    # Leases live with their holder's member row now: the ones of coordinators from before this
    # revision have none, and are released by the first grant after it.
    with op.batch_alter_table('device_leases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_device_leases_pool_heartbeat_at'))
        batch_op.drop_column('heartbeat_at')
        batch_op.add_column(sa.Column('asked_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('released_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('release_cause', sa.String(length=40), nullable=True))
        batch_op.create_index(batch_op.f('ix_device_leases_pool_released_at'), ['pool', 'released_at'], unique=False)


def downgrade() -> None:
    op.execute("DELETE FROM device_leases WHERE released_at IS NOT NULL")  # u0001 kept only live leases
    with op.batch_alter_table('device_leases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_device_leases_pool_released_at'))
        batch_op.drop_column('release_cause')
        batch_op.drop_column('released_at')
        batch_op.drop_column('asked_at')
        batch_op.add_column(sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False,
                                      server_default=sa.func.current_timestamp()))
    with op.batch_alter_table('device_leases', schema=None) as batch_op:
        batch_op.alter_column('heartbeat_at', server_default=None)
        batch_op.create_index(batch_op.f('ix_device_leases_pool_heartbeat_at'), ['pool', 'heartbeat_at'], unique=False)
    op.drop_table('device_waiters')
    op.drop_table('cluster_members')
