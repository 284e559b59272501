"""cluster probes: measured figures of a cluster for a model, per fingerprint

Revision ID: r27_0001
Revises: q25001
Create Date: 2026-12-01 21:00:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = 'r27_0001'
down_revision = 'q25001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('cluster_probes',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('env_fingerprint', sa.String(length=64), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('backend', sa.String(length=200), nullable=False),
    sa.Column('cluster', sa.JSON(), nullable=False),
    sa.Column('model', sa.JSON(), nullable=False),
    sa.Column('dtype', sa.String(length=32), nullable=False),
    sa.Column('figures', sa.JSON(), nullable=False),
    sa.Column('raw', sa.JSON(), nullable=False),
    sa.Column('env', sa.JSON(), nullable=False),
    sa.Column('wall_s', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_cluster_probes'))
    )
    with op.batch_alter_table('cluster_probes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cluster_probes_key_env_fingerprint_created_at'),
                              ['key', 'env_fingerprint', 'created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('cluster_probes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cluster_probes_key_env_fingerprint_created_at'))

    op.drop_table('cluster_probes')
