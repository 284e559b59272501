/* meshtune sweeps list: while any sweep is queued or running (the table fragment's data-live), the
   table is re-fetched every few seconds; it stops by itself once none is. The submit form below is
   not touched, so a half-typed spec survives the refresh. */
(function () {
  "use strict";
  const box = document.getElementById("sweeps-list");
  if (!box) return;
  const period = Number(box.dataset.refreshMs || 5000);

  function isLive() {
    const meta = box.querySelector("[data-live]");
    return meta !== null && meta.dataset.live === "1";
  }
  function refresh() {
    fetch(box.dataset.url, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (r.status >= 400 && r.status < 500) return null; // e.g. the login cookie expired: stop
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.text();
      })
      .then(function (html) {
        if (html === null) return;
        box.innerHTML = html;
        if (isLive()) setTimeout(refresh, period);
      })
      .catch(function () { setTimeout(refresh, period * 2); }); // coordinator restarting: retry, slower
  }
  if (isLive()) setTimeout(refresh, period);
})();
