/* meshtune trial page: measured step times (bars) and the loss of every step run (line). */
(function () {
  "use strict";
  const el = document.getElementById("trial-data");
  const div = document.getElementById("plot-trial");
  if (!el || !div || typeof Plotly === "undefined") return;
  const s = JSON.parse(el.textContent);
  const traces = [];
  if (s.step_times_ms.length) {
    traces.push({ type: "bar", name: "step time (ms)", x: s.step_times_ms.map(function (_, i) { return s.first_measured_step + i; }),
      y: s.step_times_ms, marker: { color: "#9fb7e6" }, yaxis: "y" });
  }
  if (s.losses.length) {
    traces.push({ type: "scatter", mode: "lines+markers", name: "loss", x: s.losses.map(function (_, i) { return i; }),
      y: s.losses, line: { color: "#c62828" }, yaxis: "y2" });
  }
  // Steps are whole numbers: a tick every 1, 2, 5, 10, ... steps from step 0, never one between two
  // steps (plotly's own choice for a few steps is -0.5, 0, 0.5, ...).
  const lastStep = Math.max(s.losses.length, s.first_measured_step + s.step_times_ms.length, 1) - 1;
  const raw = Math.max(1, Math.ceil(lastStep / 10));
  const decade = Math.pow(10, Math.floor(Math.log10(raw)));
  const dtick = [1, 2, 5, 10].map(function (m) { return m * decade; }).find(function (v) { return v >= raw; });
  const layout = { font: { family: "system-ui, sans-serif", size: 12 }, margin: { l: 55, r: 55, t: 10, b: 40 },
    xaxis: { title: { text: "step" }, tick0: 0, dtick: dtick, tickformat: "d" }, yaxis: { title: { text: "ms" } },
    yaxis2: { title: { text: "loss" }, overlaying: "y", side: "right" }, legend: { orientation: "h", y: -0.25 } };
  if (!traces.length) {
    layout.annotations = [{ text: "nothing measured", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5,
      font: { size: 14, color: "#5f6b7a" } }];
    layout.xaxis.visible = false; layout.yaxis.visible = false; layout.yaxis2.visible = false;
  }
  Plotly.newPlot(div, traces, layout, { responsive: true, displaylogo: false });
})();
