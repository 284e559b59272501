from tests.test_failures import _request
from workers import _watchdog


def test_dbg(ray_backend, monkeypatch):
    orig_w = _watchdog._waiting_in_collective
    seen = []

    def w(stack):
        out = orig_w(stack)
        seen.append((out, stack))
        return out

    monkeypatch.setattr(_watchdog, "_waiting_in_collective", w)
    assert ray_backend.run(_request()).status == "completed"
    for i in range(6):
        seen.clear()
        r = ray_backend.run(_request(options={"fail": "hang", "fail_rank": 3}, step_timeout_s=3.0))
        print("RANK", i, r.error.rank, r.error.message[:200], flush=True)
        if r.error.rank != 3:
            for out, st in seen:
                print("=====", out)
                print(st)
            print("TAIL", r.error.traceback_tail)
            break
        assert ray_backend.run(_request()).status == "completed"
