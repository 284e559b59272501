/* meshtune trial page: each rank's memory over the recorded step (one row per rank), its forward and
   backward phases shaded, the peak marked with where it falls, and beside it the memory model's parts
   for that rank's pipeline stage (stacked), the measured peak as a diamond. Data: #memory-data
   (api/dashboard/memory_page.py). */
(function () {
  "use strict";
  const el = document.getElementById("memory-data");
  const div = document.getElementById("plot-memory");
  if (!el || !div || typeof Plotly === "undefined") return;
  const data = JSON.parse(el.textContent);
  const ranks = data.ranks;
  if (!ranks.length) return;
  const PART_COLORS = { params: "#1565c0", grads: "#42a5f5", optimizer: "#90caf9", buffers: "#7e57c2",
    activations: "#ef6c00", working: "#ffb74d", logits: "#c62828", constants: "#8d6e63", overhead: "#b0bec5" };
  const PHASE_FILL = { forward: "rgba(66,133,244,0.16)", backward: "rgba(239,108,0,0.16)" };
  const rowH = 170, gap = 0.06 / ranks.length;
  const traces = [], shapes = [], annotations = [];
  const height = 120 + rowH * ranks.length, bottom = 96;
  const layout = { font: { family: "system-ui, sans-serif", size: 12 }, height: height,
    margin: { l: 70, r: 20, t: 24, b: bottom }, barmode: "stack", showlegend: true,
    legend: { orientation: "h", y: -44 / (height - 24 - bottom), yanchor: "top" }, hovermode: "closest" };
  ranks.forEach(function (r, i) {
    const top = 1 - i / ranks.length - gap, bottom = 1 - (i + 1) / ranks.length + gap;
    const xa = 2 * i + 1, xb = 2 * i + 2;
    const ax = function (n) { return n === 1 ? "" : String(n); };
    layout["xaxis" + ax(xa)] = { domain: [0, 0.7], anchor: "y" + ax(xa), title: i === ranks.length - 1 ? { text: "ms into the step" } : undefined, zeroline: false };
    layout["yaxis" + ax(xa)] = { domain: [bottom, top], anchor: "x" + ax(xa), title: { text: "rank " + r.rank + " · MiB" }, tickformat: ".2f", zeroline: false };
    const over = r.overhead_mib == null ? "" : " (+ " + r.overhead_mib.toFixed(0) + " MiB framework overhead, not drawn)";
    layout["xaxis" + ax(xb)] = { domain: [0.76, 1], anchor: "y" + ax(xb), zeroline: false,
      title: i === ranks.length - 1 ? { text: "MiB of tensors" + over, font: { size: 11 } } : undefined };
    layout["yaxis" + ax(xb)] = { domain: [bottom, top], anchor: "x" + ax(xb), showticklabels: true, tickfont: { size: 10 } };
    const xref = "x" + ax(xa), yref = "y" + ax(xa);
    traces.push({ type: "scatter", mode: "lines", x: r.t_ms, y: r.mib, xaxis: xref, yaxis: yref, name: "resident memory (left)",
      legendgroup: "series", showlegend: i === 0, line: { color: "#1d2330", width: 1.5 },
      hovertemplate: "%{x:.1f} ms: %{y:.3f} MiB resident<extra>rank " + r.rank + "</extra>" });
    if (r.live_peak) {  // what malloc has handed out (CPU): where the step's own allocations go, on a right axis
      const yl = "y" + (2 * ranks.length + i + 1);
      layout["yaxis" + (2 * ranks.length + i + 1)] = { overlaying: yref, anchor: xref, side: "right", showgrid: false,
        tickformat: ".1f", tickfont: { size: 10, color: "#2e7d32" }, zeroline: false };
      traces.push({ type: "scatter", mode: "lines", x: r.t_ms, y: r.live_mib, xaxis: xref, yaxis: yl, connectgaps: true,
        name: "allocated by malloc (right)", legendgroup: "live", showlegend: i === 0, line: { color: "#2e7d32", width: 1.2 },
        hovertemplate: "%{x:.1f} ms: %{y:.2f} MiB allocated<extra>rank " + r.rank + "</extra>" });
      traces.push({ type: "scatter", mode: "markers", x: [r.live_peak.t_ms], y: [r.live_peak.mib], xaxis: xref, yaxis: yl,
        name: "allocation peak", legendgroup: "livepeak", showlegend: i === 0,
        marker: { symbol: "triangle-up", size: 11, color: "#2e7d32" },
        hovertemplate: "allocation peak %{y:.2f} MiB: " + r.live_peak.where + "<extra>rank " + r.rank + "</extra>" });
    }
    // the phases: forward / backward of each micro-batch, from its marker to the next one
    const ph = r.phases, end = r.t_ms.length ? r.t_ms[r.t_ms.length - 1] : 0;
    for (let k = 0; k < ph.length; k++) {
      const fill = PHASE_FILL[ph[k][1]];
      if (!fill) continue;
      shapes.push({ type: "rect", xref: xref, yref: yref + " domain", x0: ph[k][0], x1: k + 1 < ph.length ? ph[k + 1][0] : end,
        y0: 0, y1: 1, fillcolor: fill, line: { width: 0 }, layer: "below" });
    }
    shapes.push({ type: "line", xref: xref, yref: yref, x0: 0, x1: end, y0: r.before_mib, y1: r.before_mib,
      line: { color: "#5f6b7a", width: 1, dash: "dot" } });
    // the step's own peak, where it falls; the trial's, when it was reached before or after the step
    const p = r.peak || {}, right = p.t_ms > end / 2;
    let label = "step peak " + r.step_peak_mib.toFixed(2) + " MiB: " + r.step_where;
    if (p.where === "before") label += " (the trial's peak, " + r.peak_mib.toFixed(2) + " MiB, came before the step)";
    if (p.where === "after") label += " (the trial's peak, " + r.peak_mib.toFixed(2) + " MiB, came after it)";
    traces.push({ type: "scatter", mode: "markers", x: [p.t_ms], y: [r.step_peak_mib], xaxis: xref, yaxis: yref, name: "peak (high-water mark)",
      legendgroup: "peak", showlegend: i === 0, marker: { symbol: "star", size: 13, color: "#c62828" },
      hovertemplate: "%{y:.3f} MiB: " + r.step_where + "<extra>rank " + r.rank + "</extra>" });
    annotations.push({ xref: xref, yref: yref, x: p.t_ms, y: r.step_peak_mib, text: label,
      showarrow: true, arrowhead: 0, ax: right ? -40 : 40, ay: -18, font: { size: 11, color: "#8b1a1a" },
      bgcolor: "rgba(255,255,255,0.85)", xanchor: right ? "right" : "left" });
    if (r.predicted) {
      Object.keys(data.labels).forEach(function (part) {
        traces.push({ type: "bar", orientation: "h", x: [r.predicted[part]], y: ["stage " + r.stage], xaxis: "x" + ax(xb), yaxis: "y" + ax(xb),
          name: data.labels[part], legendgroup: part, showlegend: i === 0, marker: { color: PART_COLORS[part] },
          hovertemplate: data.labels[part] + ": %{x:.3f} MiB<extra>predicted, stage " + r.stage + "</extra>" });
      });
    }
    const measured = data.peak_less_overhead ? "measured peak less the overhead" : "measured peak (allocator)";
    traces.push({ type: "scatter", mode: "markers", x: [r.comparable_peak_mib], y: ["stage " + r.stage], xaxis: "x" + ax(xb), yaxis: "y" + ax(xb),
      name: measured, legendgroup: "measured", showlegend: i === 0, marker: { symbol: "diamond", size: 11, color: "#c62828" },
      hovertemplate: measured + " %{x:.3f} MiB<extra>rank " + r.rank + "</extra>" });
  });
  layout.shapes = shapes;
  layout.annotations = annotations;
  div.innerHTML = "";
  div.style.height = layout.height + "px";
  Plotly.newPlot(div, traces, layout, { responsive: true, displaylogo: false }).then(function () { div.dataset.drawn = "1"; });
})();
