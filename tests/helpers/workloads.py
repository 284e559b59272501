"""Test workloads (``workload: tests.helpers.workloads:NAME``): the built-in model cut to the contract
(``workers.workload.builtin_parts``) under capabilities that refuse some layouts, so a test can
check that nothing the workload refuses is enumerated, proposed or run."""

from __future__ import annotations

from tuner import Capabilities
from workers.workload import Workload, builtin_parts

# The generic path realises neither cp nor ep (workers.workload.contract_problem).
CUT = Workload(name="cut", build=builtin_parts, capabilities=Capabilities(workload="cut", cp=False, ep=False))
# tp > kv_heads would need the k/v projections kept whole: declared unsupported.
NOKV = Workload(name="nokv", build=builtin_parts,
                capabilities=Capabilities(workload="nokv", cp=False, ep=False, replicated_kv=False))
NOTP = Workload(name="notp", build=builtin_parts,
                capabilities=Capabilities(workload="notp", tp=False, cp=False, ep=False, ac=("none", "full")))


def _built_where(model, training):  # noqa: ANN001, ANN202 - the Workload build signature
    """builtin_parts, recording whether it ran on a thread that runs an event loop (a server's)."""
    import asyncio

    try:
        asyncio.get_running_loop()
        BUILT_ON_LOOP.append(True)
    except RuntimeError:
        BUILT_ON_LOOP.append(False)
    return builtin_parts(model, training)


BUILT_ON_LOOP: list[bool] = []
# Built (on the meta device) when a spec naming it is validated, as the hf workload is.
WHERE = Workload(name="where", build=_built_where, capabilities=Capabilities(workload="where", cp=False, ep=False))
