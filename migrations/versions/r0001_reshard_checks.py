"""reshard checks: verdicts of moving a run between layouts through a DCP checkpoint

Revision ID: r0001
Revises: s0001
Create Date: 2026-11-29 18:30:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = 'r0001'
down_revision = 's0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('reshard_checks',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('sweep_id', sa.Integer(), nullable=False),
    sa.Column('owner', sa.String(length=200), nullable=True),
    sa.Column('from_layout', sa.JSON(), nullable=False),
    sa.Column('to_layout', sa.JSON(), nullable=False),
    sa.Column('from_key', sa.String(length=200), nullable=False),
    sa.Column('to_key', sa.String(length=200), nullable=False),
    sa.Column('steps_before', sa.Integer(), nullable=False),
    sa.Column('steps_after', sa.Integer(), nullable=False),
    sa.Column('verdict', sa.String(length=16), nullable=False),
    sa.Column('tensors_checked', sa.Integer(), nullable=False),
    sa.Column('mismatch_count', sa.Integer(), nullable=False),
    sa.Column('mismatches', sa.JSON(), nullable=False),
    sa.Column('max_abs_diff', sa.Float(), nullable=True),
    sa.Column('losses_before', sa.JSON(), nullable=False),
    sa.Column('losses_a', sa.JSON(), nullable=False),
    sa.Column('losses_b', sa.JSON(), nullable=False),
    sa.Column('max_rel_loss_diff', sa.Float(), nullable=True),
    sa.Column('tolerance', sa.Float(), nullable=False),
    sa.Column('corrupt', sa.String(length=32), nullable=True),
    sa.Column('backend', sa.String(length=200), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('save_s', sa.Float(), nullable=True),
    sa.Column('load_s', sa.Float(), nullable=True),
    sa.Column('wall_s', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['sweep_id'], ['sweeps.id'], name=op.f('fk_reshard_checks_sweep_id_sweeps'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_reshard_checks'))
    )
    with op.batch_alter_table('reshard_checks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_reshard_checks_sweep_id_created_at'), ['sweep_id', 'created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('reshard_checks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_reshard_checks_sweep_id_created_at'))

    op.drop_table('reshard_checks')
