/* meshtune sweep page: draws the charts from data.json (fetched once loaded), re-draws them with
   Plotly.react from data.json every few seconds while the sweep runs, and lazily loads the
   parameter importance (computed server-side with Optuna). */
(function () {
  "use strict";
  const root = document.getElementById("sweep-root");
  if (!root || typeof Plotly === "undefined") return;
  const urls = {
    data: root.dataset.dataUrl,
    importance: root.dataset.importanceUrl,
    tables: root.dataset.tablesUrl,
    trial: root.dataset.trialUrl, // ends with "/trials/"
  };
  const config = { responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  const font = { family: "system-ui, sans-serif", size: 12 };

  function base(extra) {
    return Object.assign({ font: font, margin: { l: 60, r: 20, t: 10, b: 45 }, hovermode: "closest",
      legend: { orientation: "v", font: { size: 11 } } }, extra);
  }
  // Plotly draws an annotation on one line and clips it at the plot's edge: a note is broken at its
  // spaces into lines that fit the narrowest card (about 56 characters at 14 px).
  function wrapNote(text, width) {
    const lines = [];
    String(text).split(" ").forEach(function (word) {
      const last = lines.length - 1;
      if (last >= 0 && (lines[last] + " " + word).length <= width) lines[last] += " " + word;
      else lines.push(word);
    });
    return lines.join("<br>");
  }
  function note(layout, traces, text) {
    if (!traces.length) {
      layout.annotations = [{ text: wrapNote(text, 56), showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5,
        font: { size: 14, color: "#5f6b7a" } }];
      layout.xaxis = Object.assign({}, layout.xaxis, { visible: false });
      layout.yaxis = Object.assign({}, layout.yaxis, { visible: false });
    }
    return layout;
  }
  function clickToTrial(div) {
    if (div.dataset.clickBound) return;
    div.dataset.clickBound = "1";
    div.on("plotly_click", function (ev) {
      const p = ev.points && ev.points[0];
      if (p && p.customdata !== undefined && p.customdata !== null) window.location.href = urls.trial + p.customdata;
    });
  }
  // Each chart's box holds a "loading" line (templates/sweep.html) until its first draw: the charts
  // wait for plotly.js, and the importance for a server-side Optuna fit, so they appear late.
  function unload(el) { el.querySelectorAll(":scope > .loading").forEach(function (e) { e.remove(); }); }
  function draw(id, traces, layout) {
    const div = document.getElementById(id);
    if (!div) return Promise.resolve();
    unload(div);
    return Plotly.react(div, traces, layout, config).then(function () { clickToTrial(div); });
  }
  // Yield to the browser between charts so the page stays responsive while a big sweep draws.
  function pause() { return new Promise(function (resolve) { setTimeout(resolve, 0); }); }

  function drawPareto(p) {
    const layout = base({
      xaxis: { title: { text: "peak memory per device (GiB)" }, rangemode: "tozero" },
      yaxis: { title: { text: "tokens/s per device" }, rangemode: "tozero" },
    });
    if (p.device_memory_gib) {
      layout.shapes = [{ type: "line", xref: "x", yref: "paper", x0: p.device_memory_gib, x1: p.device_memory_gib,
        y0: 0, y1: 1, line: { color: "#c62828", dash: "dot", width: 1.5 } }];
      layout.annotations = [{ x: p.device_memory_gib, y: 1, xref: "x", yref: "paper", text: "device memory",
        showarrow: false, xanchor: "right", yanchor: "top", font: { color: "#c62828", size: 11 } }];
    }
    return draw("plot-pareto", p.traces, note(layout, p.points ? p.traces : [], "no completed trials yet"));
  }

  function drawHeatmaps(maps) {
    const box = document.getElementById("plot-heatmaps");
    if (!box) return Promise.resolve();
    unload(box);
    if (box.children.length !== Math.max(maps.length, 1)) {
      box.innerHTML = "";
      for (let i = 0; i < Math.max(maps.length, 1); i++) {
        const d = document.createElement("div");
        d.className = "plot";
        d.id = "plot-heatmap-" + i;
        box.appendChild(d);
      }
      box.style.display = "grid";
      box.style.gridTemplateColumns = "repeat(" + Math.max(maps.length, 1) + ", 1fr)";
    }
    if (!maps.length) return draw("plot-heatmap-0", [], note(base({}), [], "no completed trials yet"));
    return Promise.all(maps.map(function (m, i) {
      const trace = { type: "heatmap", x: m.x, y: m.y, z: m.z, colorscale: "Viridis", texttemplate: "%{z:.4g}",
        hovertemplate: "%{x} %{y}<br>%{z:.4g} tok/s/dev<extra></extra>", colorbar: { title: { text: "tok/s/dev" } } };
      return draw("plot-heatmap-" + i, [trace], base({ title: { text: m.title, font: { size: 12 } }, margin: { l: 60, r: 10, t: 30, b: 40 } }));
    }));
  }

  function drawTimeline(t) {
    const layout = base({ barmode: "overlay", xaxis: { type: "date", title: { text: "wall-clock time" } },
      yaxis: { title: { text: "trial #" }, autorange: "reversed" }, bargap: 0.15 });
    return draw("plot-timeline", t.traces, note(layout, t.traces, "no trials yet"));
  }

  function drawStages(s) {
    const layout = base({ barmode: "group", yaxis: { title: { text: "ms per step" } },
      legend: { orientation: "h", x: 0, y: -0.12, yanchor: "top", font: { size: 11 } }, margin: { l: 60, r: 20, t: 10, b: 10 } });
    return draw("plot-stages", s.traces, note(layout, s.traces, s.note || "no per-stage times"));
  }

  function drawLosses(l) {
    const layout = base({ xaxis: { title: { text: "step" } }, yaxis: { title: { text: "training loss" } },
      legend: { orientation: "h", x: 0, y: -0.2, yanchor: "top", font: { size: 11 } }, margin: { l: 60, r: 20, t: 10, b: 10 } });
    return draw("plot-losses", l.traces, note(layout, l.traces, l.note || "no loss curves"));
  }

  function drawImportance(imp) {
    const traces = imp.params.length ? [{ type: "bar", orientation: "h", x: imp.importance.slice().reverse(),
      y: imp.params.slice().reverse(), marker: { color: "#5c85d6" },
      hovertemplate: "%{y}: %{x:.3f}<extra></extra>" }] : [];
    const layout = base({ xaxis: { title: { text: "importance (" + imp.evaluator + ")" }, range: [0, 1] },
      margin: { l: 80, r: 20, t: 10, b: 45 } });
    return draw("plot-importance", traces, note(layout, traces, imp.note || "not available"));
  }

  function setFacts(s) {
    document.querySelectorAll("[data-fact]").forEach(function (el) {
      const v = el.dataset.fact.split(".").reduce(function (o, k) { return o == null ? o : o[k]; }, s);
      if (v !== undefined && v !== null) el.textContent = v;
    });
    const sim = document.getElementById("fact-simulated-time");
    if (sim) sim.hidden = !s.summary.device_time_simulated;
    const stop = document.getElementById("stop-reason"); // why the sweep ended, once it has
    if (stop && s.stop_reason && !document.querySelector(".banner.err")) stop.hidden = false;
  }

  async function drawAll(b) {
    await drawPareto(b.pareto); await pause();
    await drawHeatmaps(b.heatmaps); await pause();
    await drawTimeline(b.timeline); await pause();
    await drawStages(b.stages); await pause();
    await drawLosses(b.losses);
  }

  function loadImportance() {
    fetch(urls.importance, { credentials: "same-origin" }).then(function (r) { return r.json(); })
      .then(drawImportance).catch(function (e) { drawImportance({ params: [], importance: [], evaluator: "", note: String(e) }); });
  }

  // The charts' data is fetched, not embedded: the page stays one page of tables (tens of kB) while
  // a 10,000-trial sweep's chart data is ~1 MB (served with an ETag, so a reload revalidates it).
  let live = false;
  const period = Number(root.dataset.refreshMs || 5000);
  let lastCompleted = null;
  let lastCounts = null;
  function start(initial) {
    window.meshtuneDashboard = { initial: initial };
    live = initial.live;
    lastCompleted = initial.summary.counts.completed;
    lastCounts = JSON.stringify(initial.summary.counts);
    drawAll(initial).then(loadImportance);
    if (live) setTimeout(refresh, period);
  }
  function load() {
    fetch(urls.data, { credentials: "same-origin" }).then(function (r) { return r.json(); }).then(start)
      .catch(function () { setTimeout(load, period); });
  }
  function refresh() {
    fetch(urls.data, { credentials: "same-origin" }).then(function (r) { return r.json(); }).then(async function (b) {
      await drawAll(b);
      setFacts(b);
      const badge = document.querySelector('[data-fact="status"]');
      if (badge) badge.className = "badge s-" + b.status;
      if (b.summary.counts.completed !== lastCompleted) { lastCompleted = b.summary.counts.completed; loadImportance(); }
      const tables = document.getElementById("tables");
      const counts = JSON.stringify(b.summary.counts);
      if (tables && counts !== lastCounts) { // the tables change only when a trial does
        lastCounts = counts;
        fetch(urls.tables + window.location.search, { credentials: "same-origin" })
          .then(function (r) { return r.text(); }).then(function (html) {
            tables.innerHTML = html;
            document.dispatchEvent(new CustomEvent("meshtune:tables")); // migrate.js re-attaches its panel
          });
      }
      live = b.live;
      const stamp = document.getElementById("refreshed");
      if (stamp) stamp.textContent = live ? "live — updated " + new Date().toLocaleTimeString() : "finished";
      if (live) setTimeout(refresh, period);
    }).catch(function () { setTimeout(refresh, period * 2); });
  }
  load();
})();
