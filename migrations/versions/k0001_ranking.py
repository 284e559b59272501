"""ranked_layouts and ranking_states: the ranking maintained as results land, with a
backfill of every existing sweep

Revision ID: k0001
Revises: q0001
Create Date: 2026-12-01 12:00:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = 'k0001'
down_revision = 'q0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'ranked_layouts',
        sa.Column('sweep_id', sa.Integer(), nullable=False),
        sa.Column('metric', sa.String(length=32), nullable=False),
        sa.Column('layout_key', sa.String(length=200), nullable=False),
        sa.Column('layout', sa.JSON(), nullable=False),
        sa.Column('first_number', sa.Integer(), nullable=False),
        sa.Column('n', sa.Integer(), nullable=False),
        sa.Column('median', sa.Float(), nullable=False),
        sa.Column('mean_log', sa.Float(), nullable=True),
        sa.Column('own_low', sa.Float(), nullable=True),
        sa.Column('own_high', sa.Float(), nullable=True),
        sa.Column('noise_ss', sa.Float(), nullable=True),
        sa.Column('noise_dof', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=True),
        sa.Column('low', sa.Float(), nullable=True),
        sa.Column('high', sa.Float(), nullable=True),
        sa.Column('tie_group', sa.Integer(), nullable=True),
        sa.Column('tied_with_best', sa.Boolean(), nullable=True),
        sa.Column('tokens_per_s_per_device', sa.Float(), nullable=True),
        sa.Column('useful_tokens_per_s', sa.Float(), nullable=True),
        sa.Column('useful_tokens_per_s_per_device', sa.Float(), nullable=True),
        sa.Column('peak_memory_median', sa.Float(), nullable=True),
        sa.Column('predictions', sa.JSON(), nullable=False),
        sa.Column('simulated', sa.Boolean(), nullable=False),
        sa.Column('trial_numbers', sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(['sweep_id'], ['sweeps.id'], name=op.f('fk_ranked_layouts_sweep_id_sweeps'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('sweep_id', 'metric', 'layout_key', name=op.f('pk_ranked_layouts')),
    )
    with op.batch_alter_table('ranked_layouts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ranked_layouts_sweep_id_metric_rank'), ['sweep_id', 'metric', 'rank'],
                              unique=False)
    op.create_table(
        'ranking_states',
        sa.Column('sweep_id', sa.Integer(), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('ranked_version', sa.Integer(), nullable=False),
        sa.Column('summary', sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(['sweep_id'], ['sweeps.id'], name=op.f('fk_ranking_states_sweep_id_sweeps'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('sweep_id', name=op.f('pk_ranking_states')),
    )
    _backfill()


def _backfill() -> None:
    """Rank every stored sweep that has a measurement. The aggregation is the store's own
    (api.store._ranking.rebuild: one definition of the ranking), reading only columns that exist
    at this revision; a sweep left out here is still ranked on its first read."""
    from sqlalchemy.orm import Session

    from api.store._ranking import rebuild

    bind = op.get_bind()
    ids = [row[0] for row in bind.execute(sa.text(
        "SELECT DISTINCT sweep_id FROM trials WHERE status = 'completed' AND tokens_per_s_per_device IS NOT NULL"))]
    if not ids:
        return
    session = Session(bind=bind)
    try:
        for sweep_id in ids:
            rebuild(session, sweep_id=sweep_id)
        session.flush()
    finally:
        session.close()


def downgrade() -> None:
    op.drop_table('ranking_states')
    with op.batch_alter_table('ranked_layouts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ranked_layouts_sweep_id_metric_rank'))
    op.drop_table('ranked_layouts')
