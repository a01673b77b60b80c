// The operator console's auto-refresh: every few seconds it fetches the page it shows again and
// swaps in the new content of each element marked data-live (matched by id), without reloading
// the page. Nothing else on the page depends on it: without JavaScript the console is the same
// pages, refreshed by reloading them.
"use strict";
(function () {
  var seconds = Number(document.body.getAttribute("data-refresh")) || 0;
  var status = document.getElementById("live-status");
  if (!(seconds > 0) || !window.fetch || !window.DOMParser) {
    return;
  }
  var busy = false;

  function say(text, stale) {
    if (status) {
      status.textContent = text;
      status.className = stale ? "stale" : "";
    }
  }

  function swap(html) {
    var fresh = new DOMParser().parseFromString(html, "text/html");
    var live = document.querySelectorAll("[data-live][id]");
    for (var i = 0; i < live.length; i++) {
      var old = live[i];
      // A form being filled in or a control in use is left alone until the next refresh.
      if (old.contains(document.activeElement) && document.activeElement !== document.body) {
        continue;
      }
      var next = fresh.getElementById(old.id);
      if (next && next.innerHTML !== old.innerHTML) {
        old.innerHTML = next.innerHTML;
      }
    }
  }

  function refresh() {
    if (busy || document.hidden) {
      return;
    }
    busy = true;
    fetch(window.location.href, {
      credentials: "same-origin",
      cache: "no-store",
      headers: { "X-Console-Refresh": "1" },
    })
      .then(function (response) {
        if (!response.ok && response.status !== 503) {
          throw new Error("HTTP " + response.status);
        }
        return response.text();
      })
      .then(function (html) {
        swap(html);
        say("live: updated " + new Date().toLocaleTimeString(), false);
      })
      .catch(function (err) {
        say("live: refresh failed (" + err.message + "), retrying", true);
      })
      .then(function () {
        busy = false;
      });
  }

  say("live: every " + seconds + " s", false);
  window.setInterval(refresh, seconds * 1000);
})();
