"""Re-key the trials of sweeps stored before canonical layout keys: every trial's layout becomes the
one layout that names its program (tuner.canonical_layout), so twins measured as two layouts are one
ranked layout and a resumed old sweep sees its twins as already measured. No schema change.

Each changed sweep's stored ranking is rebuilt by the store's own code (api.store._ranking.rebuild;
its results version moves, so no cached answer or ETag of the old keys is served again) and its
listing cache refreshed; a sweep whose spec no longer builds a problem is left as it is (logged).
Downgrade keeps the canonical keys: they name the programs that ran, and older code reads them.

Revision ID: d210001
Revises: u0001
Create Date: 2026-12-01 21:00:00.000000
"""
from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op

revision = 'd210001'
down_revision = 'u0001'
branch_labels = None
depends_on = None

log = logging.getLogger("alembic.runtime.migration")
_SWEEPS = sa.table("sweeps", sa.column("id", sa.Integer), sa.column("spec", sa.JSON))
_TRIALS = sa.table("trials", sa.column("id", sa.Integer), sa.column("sweep_id", sa.Integer),
                   sa.column("layout", sa.JSON), sa.column("layout_key", sa.String))


def upgrade() -> None:
    from sqlalchemy.orm import Session

    from api.spec import SweepSpec
    from api.store._ranking import rebuild
    from api.store._sweeps import refresh_sweep_cache
    from tuner import Layout, canonical_layout

    bind = op.get_bind()
    session = Session(bind=bind)
    try:
        for sweep_id, spec in bind.execute(sa.select(_SWEEPS.c.id, _SWEEPS.c.spec).order_by(_SWEEPS.c.id)).all():
            try:  # the problem's training (global batch) decides the micro-batch count, so the twins
                training = SweepSpec.model_construct(**(spec or {})).to_problem().training
            except Exception as exc:  # noqa: BLE001 - an old spec that no longer builds: left as it is
                log.warning("sweep %s: not re-keyed, its spec does not build a problem (%s)", sweep_id, exc)
                continue
            changed = 0
            rows = bind.execute(sa.select(_TRIALS.c.id, _TRIALS.c.layout, _TRIALS.c.layout_key)
                                .where(_TRIALS.c.sweep_id == sweep_id)).all()
            for trial_id, layout, key in rows:
                try:
                    canon = canonical_layout(Layout(**layout), training=training)
                except (TypeError, ValueError):  # not a layout this code knows: left as it is
                    continue
                as_dict = {name: getattr(canon, name) for name in Layout.__dataclass_fields__}
                if canon.key != key or as_dict != layout:
                    bind.execute(sa.update(_TRIALS).where(_TRIALS.c.id == trial_id)
                                 .values(layout=as_dict, layout_key=canon.key))
                    changed += 1
            if changed:
                rebuild(session, sweep_id=sweep_id)
                refresh_sweep_cache(session, sweep_id=sweep_id)
                session.flush()
                log.info("sweep %s: %s trial(s) re-keyed to canonical layouts", sweep_id, changed)
    finally:
        session.close()


def downgrade() -> None:
    """Nothing to undo: the canonical keys name the programs that ran (see the module docstring)."""
