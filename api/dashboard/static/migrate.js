/* meshtune sweep page: "check migration" on a ranked layout (issue 8).

   The button opens one panel under its row: the target layout (a select of the top of the ranking,
   the best by default), the step counts and, when the coordinator has tokens, a token field. "Run
   check" posts {from_layout, to_layout, steps_before, steps_after} to the API's own
   POST /api/sweeps/{id}/reshard-check (which blocks while it trains, saves and reloads: 5-30 s),
   shows a spinner meanwhile, then the verdict, or the API's message (a refused layout is a 422
   naming the field). The tables are then re-fetched, so the check appears under "Migration checks".
   The panel is a single element kept across table refreshes (live sweeps re-render the tables). */
(function () {
  "use strict";
  const root = document.getElementById("sweep-root");
  if (!root || !root.dataset.reshardUrl) return;
  const postUrl = root.dataset.reshardUrl;
  const authOn = root.dataset.auth === "1";
  let panel = null; // {tr, key, parts: {...}}
  let running = false;

  function h(tag, attrs, children) {
    const el = document.createElement(tag);
    Object.entries(attrs || {}).forEach(function ([k, v]) {
      if (k === "text") el.textContent = v;
      else if (k === "className") el.className = v;
      else el.setAttribute(k, v);
    });
    (children || []).forEach(function (c) { el.append(c); });
    return el;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "—";
    if (v === 0) return "0";
    const a = Math.abs(v);
    return a < 1e-3 || a >= 1e5 ? v.toExponential(1) : String(Number(v.toPrecision(3)));
  }
  function secs(v) { return v === null || v === undefined ? "—" : (v >= 1 ? v.toFixed(1) + " s" : Math.round(v * 1000) + " ms"); }
  function targets() {
    const el = document.getElementById("migration-targets");
    return el ? JSON.parse(el.textContent) : [];
  }
  function rankingBody() { return document.querySelector("#ranking-table tbody"); }

  function build(row) {
    const key = row.dataset.key;
    const options = targets().filter(function (t) { return t.key !== key; });
    const select = h("select", { className: "mig-to", "aria-label": "target layout" }, options.map(function (t, i) {
      return h("option", { value: String(i), text: "#" + t.rank + "  " + t.label + (t.rank === 1 ? "  (best)" : "") });
    }));
    const before = h("input", { type: "number", min: "1", value: "2", className: "mig-before", "aria-label": "steps before" });
    const after = h("input", { type: "number", min: "1", value: "2", className: "mig-after", "aria-label": "steps after" });
    const token = h("input", { type: "password", autocomplete: "off", className: "mig-token", "aria-label": "token" });
    const runBtn = h("button", { type: "button", className: "mig-run", text: "Run check" });
    const close = h("button", { type: "button", className: "mig-close", title: "close", text: "✕" });
    const out = h("div", { className: "mig-out", role: "status", "aria-live": "polite" });
    const form = h("div", { className: "mig-form" }, [
      h("span", { className: "mig-title", text: "Check migration" }), " from ",
      h("b", { className: "mig-from", text: row.dataset.label }), h("span", { className: "muted", text: " (rank " + row.dataset.rank + ")" }),
      " to ", select,
      h("label", {}, ["steps before the save ", before]), h("label", {}, ["after ", after]),
    ]);
    if (authOn) form.append(h("label", {}, ["token ", token]));
    form.append(runBtn, close);
    const cell = h("td", { colspan: String(row.children.length) }, [h("div", { className: "mig" }, [
      form,
      h("p", { className: "caption", text: "Trains A, saves model and optimizer (torch.distributed.checkpoint), loads " +
        "under B and continues; every tensor must be bit-identical after the load and B's losses must match an " +
        "uninterrupted A run. Blocks while it runs (5–30 s); the result is stored with the sweep." }),
      out,
    ])]);
    const tr = h("tr", { className: "mig-panel" }, [cell]);
    const parts = { select: select, before: before, after: after, token: token, run: runBtn, out: out, options: options,
      from: JSON.parse(row.dataset.layout) };
    runBtn.addEventListener("click", function () { run(parts); });
    close.addEventListener("click", function () { if (!running) { tr.remove(); panel = null; } });
    if (!options.length) { runBtn.disabled = true; out.textContent = "No other ranked layout to move to."; }
    return { tr: tr, key: key, parts: parts };
  }

  function open(row) {
    if (running) return; // one check at a time; its panel stays where it is
    const keep = panel ? panel.parts.token.value : "";
    if (panel) panel.tr.remove();
    panel = build(row);
    panel.parts.token.value = keep;
    row.after(panel.tr);
    panel.parts.select.focus();
  }

  function reattach() { // after the tables were re-rendered: back under its row (or on top)
    if (!panel) return;
    const body = rankingBody();
    if (!body) { panel.tr.remove(); panel = null; return; }
    const row = body.querySelector('tr[data-key="' + CSS.escape(panel.key) + '"]');
    if (row) row.after(panel.tr); else body.prepend(panel.tr);
  }
  document.addEventListener("meshtune:tables", reattach);

  function refreshTables() {
    const tables = document.getElementById("tables");
    return fetch(root.dataset.tablesUrl + window.location.search, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(new Error("HTTP " + r.status)); })
      .then(function (html) { tables.innerHTML = html; reattach(); });
  }

  function spinner(out) {
    const clock = h("span", { className: "muted", text: "0 s" });
    out.replaceChildren(h("div", { className: "mig-running" }, [
      h("span", { className: "spinner", "aria-hidden": "true" }),
      " Running the check: training under A, saving, loading under B, continuing… ", clock,
    ]));
    const t0 = Date.now();
    return setInterval(function () { clock.textContent = Math.round((Date.now() - t0) / 1000) + " s"; }, 1000);
  }

  const HEADLINES = {
    ok: function (c) {
      return "Safe to move: all " + c.tensors_checked + " parameter and optimizer tensors are bit-identical after the load, " +
        "and B's continued losses match an uninterrupted A run (max relative difference " + fmt(c.max_rel_loss_diff) +
        " ≤ tolerance " + fmt(c.tolerance) + ").";
    },
    corrupted: function (c) {
      return "Corrupted: " + c.mismatch_count + " of " + c.tensors_checked + " tensors differ after the load (max |Δ| " +
        fmt(c.max_abs_diff) + "). Do not move a run this way.";
    },
    diverged: function (c) {
      return "Diverged: the state is bit-identical after the load, but B's continued losses differ from A's by " +
        fmt(c.max_rel_loss_diff) + " (tolerance " + fmt(c.tolerance) + ").";
    },
    failed: function (c) { return "The check itself failed: " + String(c.error || "no error text").split("\n")[0]; },
  };

  function verdict(c) {
    const head = (HEADLINES[c.verdict] || HEADLINES.failed)(c);
    const box = h("div", { className: "mig-verdict v-" + c.verdict }, [
      h("span", { className: "badge v-" + c.verdict, text: c.verdict }), " ", h("span", { className: "mig-headline", text: head }),
    ]);
    const facts = h("div", { className: "mig-facts small muted", text:
      "check #" + c.id + " · " + c.steps_before + " steps under A + " + c.steps_after + " continued · save " + secs(c.save_s) +
      " · load " + secs(c.load_s) + " · total " + secs(c.wall_s) + " · backend " + c.backend });
    box.append(facts);
    if ((c.losses_a || []).length) {
      box.append(h("div", { className: "mig-facts small", text: "losses, A uninterrupted: " + c.losses_a.map(fmt).join(", ") +
        "   ·   B after the load: " + (c.losses_b || []).map(fmt).join(", ") }));
    }
    if ((c.mismatches || []).length) {
      box.append(h("ul", { className: "mig-mismatches small" }, c.mismatches.slice(0, 5).map(function (m) {
        return h("li", { text: m.key + ": " + m.detail + (m.max_abs_diff !== null ? " (max |Δ| " + fmt(m.max_abs_diff) + ")" : "") });
      })));
    }
    if (c.error && c.verdict === "failed") box.append(h("pre", { text: c.error }));
    return box;
  }

  function refusal(status, body) {
    let detail = body && body.detail !== undefined ? body.detail : body;
    if (typeof detail !== "string") detail = JSON.stringify(detail);
    const what = { 401: "Needs a token", 403: "Not allowed", 404: "Not found", 409: "Conflict", 422: "Refused" }[status] || "Failed";
    return h("div", { className: "mig-error" }, [h("b", { text: what + " (HTTP " + status + "): " }), h("span", { text: detail })]);
  }

  function run(p) {
    if (running) return;
    const target = p.options[Number(p.select.value)];
    const body = { from_layout: p.from, to_layout: target.layout,
      steps_before: Number(p.before.value), steps_after: Number(p.after.value) };
    const headers = { "Content-Type": "application/json", "Accept": "application/json" };
    if (p.token.value) headers.Authorization = "Bearer " + p.token.value;
    running = true;
    [p.run, p.select, p.before, p.after, p.token].forEach(function (el) { el.disabled = true; });
    const timer = spinner(p.out);
    let shown = null;
    fetch(postUrl, { method: "POST", headers: headers, body: JSON.stringify(body), credentials: "same-origin" })
      .then(function (r) {
        return r.text().then(function (text) {
          let parsed = text;
          try { parsed = JSON.parse(text); } catch (e) { /* a proxy's HTML error page: shown as text */ }
          return { ok: r.ok, status: r.status, body: parsed };
        });
      })
      .then(function (res) {
        shown = res.ok ? verdict(res.body) : refusal(res.status, res.body);
        return res.ok ? refreshTables().catch(function () {}) : null;
      })
      .catch(function (e) { shown = refusal(0, "the coordinator did not answer (" + e + ")"); })
      .finally(function () {
        clearInterval(timer);
        running = false;
        [p.run, p.select, p.before, p.after, p.token].forEach(function (el) { el.disabled = false; });
        p.out.replaceChildren(shown);
      });
  }

  document.addEventListener("click", function (ev) {
    const btn = ev.target.closest && ev.target.closest("button.mig-open");
    if (btn) open(btn.closest("tr"));
  });
})();
