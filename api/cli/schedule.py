"""``meshtune schedule add|list|rm|run-now|alerts``: scheduled sweeps on the configured store.

The coordinator (``meshtune serve``) fires them; these commands only read and write the store, so
they work whether or not a coordinator is running. Bad input exits 2 naming the field.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tuner import SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="scheduled sweeps: add, list, rm, run-now, alerts",
                       description="Manage scheduled sweeps (cron + time zone) with regression alerts.")
    cmds = p.add_subparsers(dest="schedule_command", metavar="ACTION", required=True)

    a = cmds.add_parser("add", help="add a schedule", description="Add a schedule: a cron expression in a time "
                        "zone, and what to run: a sweep spec file (--template) or the top-k layouts of a sweep "
                        "(--remeasure SWEEP_ID).")
    a.add_argument("--name", required=True, help="label of the schedule")
    a.add_argument("--cron", required=True, help="cron expression, e.g. '0 2 * * *' (02:00 daily)")
    a.add_argument("--timezone", default="UTC", help="IANA time zone of the cron expression (default UTC)")
    what = a.add_mutually_exclusive_group(required=True)
    what.add_argument("--template", metavar="SPEC", help="sweep spec file (.yaml/.toml/.json) to run at each fire")
    what.add_argument("--remeasure", metavar="SWEEP_ID", type=_id, help="re-measure the top-k layouts of this sweep")
    a.add_argument("--top-k", type=int, default=3, help="layouts to re-measure (with --remeasure; default 3)")
    a.add_argument("--repeats", type=int, default=3, help="measurements per layout (with --remeasure; default 3)")
    a.add_argument("--webhook", help="http(s) URL that receives alerts as a JSON POST")
    a.add_argument("--grace", type=float, default=7200.0, help="misfire grace window in seconds (default 7200)")
    a.add_argument("--min-effect", type=float, default=0.05, help="smallest alerted change (default 0.05 = 5%%)")
    a.add_argument("--alpha", type=float, default=0.05, help="false-alarm rate per night (default 0.05)")
    a.add_argument("--priority", default="normal", metavar="PRIORITY",
                   help="queue priority of the sweeps it fires: high, normal or low (default normal, as a "
                        "submitted sweep's; fair share between owners comes first)")
    a.add_argument("--disabled", action="store_true", help="create it disabled")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=add_cmd)

    ls = cmds.add_parser("list", help="list schedules", description="List schedules with their next fire.")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=list_cmd)

    rm = cmds.add_parser("rm", help="delete a schedule", description="Delete a schedule, its fires and alerts.")
    rm.add_argument("id", type=_id)
    rm.set_defaults(func=rm_cmd)

    rn = cmds.add_parser("run-now", help="fire a schedule now", description="Queue the schedule's sweeps now; "
                         "a running coordinator runs them and checks the result for regressions.")
    rn.add_argument("id", type=_id)
    rn.add_argument("--json", action="store_true")
    rn.set_defaults(func=run_now_cmd)

    al = cmds.add_parser("alerts", help="list alerts", description="Regression, improvement and failure alerts.")
    al.add_argument("--schedule", type=_id, help="only this schedule's alerts")
    al.add_argument("--limit", type=int, default=50)
    al.add_argument("--json", action="store_true")
    al.set_defaults(func=alerts_cmd)


def _sessions() -> Any:
    from api import store
    from api.settings import Settings

    _, sessions = store.open_store(Settings().resolved_database_url)
    return sessions


def _validation_error(exc: Any, data: dict[str, Any]) -> SpecError:
    """The API's own one-line 422 detail (api.errors), so the CLI names the field and value the same
    way and masks what the API masks (a webhook URL's secret)."""
    from fastapi.exceptions import RequestValidationError

    from api.errors import detail_line, field_errors

    errs = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    items = field_errors(RequestValidationError(errs, body=data), data)
    return SpecError(detail_line(items[0]) if items else str(exc))


def _id(text: str) -> int:
    """An id argument: the store's ids are 32-bit (api.deps.MAX_ID); anything else exits 2 naming it."""
    from api.deps import MAX_ID

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer id") from None
    if not 1 <= value <= MAX_ID:
        raise argparse.ArgumentTypeError(f"{value} is not an id between 1 and {MAX_ID}")
    return value


def _dump(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def add_cmd(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from api.cli.sweep import load_spec
    from api.schedules import service as svc
    from api.schedules.schemas import ScheduleIn

    data: dict[str, Any] = dict(
        name=args.name, cron=args.cron, timezone=args.timezone, webhook_url=args.webhook, enabled=not args.disabled,
        misfire_grace_s=args.grace, regression={"min_effect": args.min_effect, "alpha": args.alpha},
        priority=args.priority,
    )
    if args.template:
        data["template"] = load_spec(args.template)
    else:
        data["remeasure"] = {"sweep_id": args.remeasure, "top_k": args.top_k, "repeats": args.repeats}
    try:
        schedule_in = ScheduleIn.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, data) from None
    sessions = _sessions()
    with sessions() as s:
        row = svc.create_schedule(s, data=schedule_in, owner="cli")
        out = svc.describe(row)
    if args.json:
        _dump(out.model_dump(mode="json"))
    else:
        print(f"schedule {out.id} {out.name!r}: {out.cron} ({out.timezone}), priority {out.priority}, "
              f"next fire {out.next_fire_at or '-'}")
    return 0


def list_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from api.schedules import service as svc

    sessions = _sessions()
    with sessions() as s:
        rows, total = svc.list_schedules(s, limit=1000)
        items = [svc.describe(r) for r in rows]
    if args.json:
        _dump({"items": [i.model_dump(mode="json") for i in items], "total": total})
        return 0
    table = Table(title=f"schedules ({total})")
    for col in ("id", "name", "cron", "timezone", "runs", "priority", "enabled", "next fire (UTC)", "webhook"):
        table.add_column(col)
    for i in items:
        what = f"sweep {i.source_sweep_id} top-{i.top_k} x{i.repeats}" if i.kind == "remeasure" else "template"
        table.add_row(str(i.id), i.name, i.cron, i.timezone, what, i.priority, "yes" if i.enabled else "no",
                      i.next_fire_at.strftime("%Y-%m-%d %H:%M:%S") if i.next_fire_at else "-", i.webhook_url or "-")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def rm_cmd(args: argparse.Namespace) -> int:
    from api.schedules import service as svc

    sessions = _sessions()
    with sessions() as s:
        svc.delete_schedule(s, schedule_id=args.id)
    print(f"schedule {args.id} deleted")
    return 0


def run_now_cmd(args: argparse.Namespace) -> int:
    from api.schedules import service as svc
    from api.schedules.schemas import FireOut

    sessions = _sessions()
    with sessions() as s:
        fire = FireOut.model_validate(svc.run_now(s, schedule_id=args.id, by="cli"))
    if args.json:
        _dump(fire.model_dump(mode="json"))
    elif fire.status == "failed":
        print(f"schedule {args.id}: fire {fire.id} could not start: {fire.error}")
        return 1
    else:
        print(f"schedule {args.id}: fire {fire.id} queued sweep(s) {', '.join(map(str, fire.sweep_ids))}")
    return 0


def alerts_cmd(args: argparse.Namespace) -> int:
    from api.schedules import service as svc
    from api.schedules.schemas import AlertOut

    sessions = _sessions()
    with sessions() as s:
        rows, total = svc.list_alerts(s, schedule_id=args.schedule, limit=args.limit)
        items = [AlertOut.model_validate(r) for r in rows]
    if args.json:
        _dump({"items": [i.model_dump(mode="json") for i in items], "total": total})
        return 0
    for a in items:
        print(f"#{a.id} {a.created_at:%Y-%m-%d %H:%M} {a.kind:<11} [{a.delivery_status}] {a.message}")
    if not items:
        print("no alerts")
    return 0
