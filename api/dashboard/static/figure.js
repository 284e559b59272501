/* meshtune dashboard: draws each chart whose plotly figure the page embeds, for pages with no
   script of their own (the plan page's size comparison, a schedule's trends):
     <div class="plot" data-figure='{"data": [...], "layout": {...}}' data-layout='{...}'>
   data-layout holds what the page adds to the figure's layout (margins, axis titles); the figure's
   own layout keys win over it. Loaded deferred after plotly.js, so the DOM is parsed when it runs. */
(function () {
  "use strict";
  if (typeof Plotly === "undefined") return;
  document.querySelectorAll("[data-figure]").forEach(function (el) {
    const fig = JSON.parse(el.dataset.figure);
    const layout = Object.assign({}, el.dataset.layout ? JSON.parse(el.dataset.layout) : {}, fig.layout);
    Plotly.newPlot(el, fig.data, layout, { responsive: true, displaylogo: false });
  });
})();
