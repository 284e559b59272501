"""schedules, their fires (unique per schedule and fire time: the single-fire guarantee), alerts and
webhook delivery attempts

Revision ID: s0001
Revises: 0001
Create Date: 2026-11-29 18:00:02.365852
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = 's0001'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('schedules',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('owner', sa.String(length=200), nullable=True),
    sa.Column('cron', sa.String(length=200), nullable=False),
    sa.Column('timezone', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('template', sa.JSON(), nullable=True),
    sa.Column('source_sweep_id', sa.Integer(), nullable=True),
    sa.Column('top_k', sa.Integer(), nullable=True),
    sa.Column('repeats', sa.Integer(), nullable=False),
    sa.Column('enabled', sa.Boolean(), nullable=False),
    sa.Column('webhook_url', sa.Text(), nullable=True),
    sa.Column('misfire_grace_s', sa.Float(), nullable=False),
    sa.Column('policy', sa.JSON(), nullable=False),
    sa.Column('active_since', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['source_sweep_id'], ['sweeps.id'], name=op.f('fk_schedules_source_sweep_id_sweeps'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_schedules'))
    )
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_schedules_enabled'), ['enabled'], unique=False)

    op.create_table('schedule_fires',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('schedule_id', sa.Integer(), nullable=False),
    sa.Column('fire_time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('trigger', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('claimed_by', sa.String(length=200), nullable=True),
    sa.Column('sweep_ids', sa.JSON(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('env', sa.JSON(), nullable=True),
    sa.Column('env_changes', sa.JSON(), nullable=True),
    sa.Column('comparisons', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['schedule_id'], ['schedules.id'], name=op.f('fk_schedule_fires_schedule_id_schedules'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_schedule_fires')),
    sa.UniqueConstraint('schedule_id', 'fire_time', name=op.f('uq_schedule_fires_schedule_id_fire_time'))
    )
    with op.batch_alter_table('schedule_fires', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_schedule_fires_status'), ['status'], unique=False)

    op.create_table('schedule_alert_deliveries',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('fire_id', sa.Integer(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('alert_ids', sa.JSON(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['fire_id'], ['schedule_fires.id'], name=op.f('fk_schedule_alert_deliveries_fire_id_schedule_fires'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_schedule_alert_deliveries'))
    )
    with op.batch_alter_table('schedule_alert_deliveries', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_schedule_alert_deliveries_fire_id'), ['fire_id'], unique=False)

    op.create_table('schedule_alerts',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('schedule_id', sa.Integer(), nullable=False),
    sa.Column('fire_id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('layout_key', sa.String(length=200), nullable=True),
    sa.Column('ratio', sa.Float(), nullable=True),
    sa.Column('ratio_low', sa.Float(), nullable=True),
    sa.Column('ratio_high', sa.Float(), nullable=True),
    sa.Column('p_value', sa.Float(), nullable=True),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('detail', sa.JSON(), nullable=False),
    sa.Column('delivery_status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['fire_id'], ['schedule_fires.id'], name=op.f('fk_schedule_alerts_fire_id_schedule_fires'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['schedule_id'], ['schedules.id'], name=op.f('fk_schedule_alerts_schedule_id_schedules'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_schedule_alerts')),
    sa.UniqueConstraint('fire_id', 'kind', 'layout_key', name=op.f('uq_schedule_alerts_fire_id_kind_layout_key'))
    )
    with op.batch_alter_table('schedule_alerts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_schedule_alerts_delivery_status'), ['delivery_status'], unique=False)
        batch_op.create_index(batch_op.f('ix_schedule_alerts_schedule_id_created_at'), ['schedule_id', 'created_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('schedule_alerts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_schedule_alerts_schedule_id_created_at'))
        batch_op.drop_index(batch_op.f('ix_schedule_alerts_delivery_status'))

    op.drop_table('schedule_alerts')
    with op.batch_alter_table('schedule_alert_deliveries', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_schedule_alert_deliveries_fire_id'))

    op.drop_table('schedule_alert_deliveries')
    with op.batch_alter_table('schedule_fires', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_schedule_fires_status'))

    op.drop_table('schedule_fires')
    with op.batch_alter_table('schedules', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_schedules_enabled'))

    op.drop_table('schedules')
