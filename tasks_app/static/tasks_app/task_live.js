/*
 * The live output pane of the admin's task page.
 *
 * The page renders the task's text as of event N (data-cursor; the exact
 * string is in #lmsp-initial-text, since HTML parsing turns a carriage return
 * into a newline) and, while the task is unfinished, opens the
 * task's event stream after it (?starting_after=N; the staff session cookie
 * authenticates it). Deltas are appended, a new output item (a rerun) starts
 * the text over, and the status follows the response.* events. On a dropped
 * connection EventSource reconnects by itself and sends Last-Event-ID, which
 * the server prefers to the URL's cursor, so nothing is repeated; ids at or
 * below the newest one seen are ignored all the same. After the terminal event
 * the page closes the stream (a reconnect would get 204, which also ends it)
 * and reloads itself once, so that the fields below (status, tokens, worker,
 * error, newest events) say what the header says; a finished task's page
 * opens no stream, so there is no second reload. A response.queued (the task
 * was handed back and waits for a rerun) empties the text and reloads too.
 * Beside the stream, the page polls the task's heartbeat age while a worker
 * holds it (liveness/), and says so when the worker went silent.
 */
(function () {
  "use strict";

  // While a worker holds the task: its heartbeat's age, every 2 s, and a warning once it is silent
  // (a frozen worker keeps the event stream open, so the stream alone cannot tell).
  var summary = document.getElementById("lmsp-summary");
  if (summary && summary.dataset.livenessUrl && window.fetch) {
    var beatEl = document.getElementById("lmsp-heartbeat");
    var silentNote = document.getElementById("lmsp-silent-note");
    var silentAge = document.getElementById("lmsp-silent-age");
    var poll = function () {
      window.fetch(summary.dataset.livenessUrl, { credentials: "same-origin" })
        .then(function (reply) { return reply.ok ? reply.json() : null; })
        .then(function (live) {
          if (!live) {
            return;
          }
          if (!live.held) {
            beatEl.textContent = "-";
            beatEl.className = "";
            silentNote.hidden = true;
            return;
          }
          beatEl.textContent = live.heartbeat_age === null ? "none yet" : live.heartbeat_age.toFixed(1) + " s ago";
          beatEl.className = live.silent ? "lmsp-status lmsp-status-silent" : "";
          silentNote.hidden = !live.silent;
          if (live.silent) {
            silentAge.textContent = String(Math.round(live.heartbeat_age));
          }
        })
        .catch(function () {});
    };
    window.setInterval(poll, 2000);
  }

  var pane = document.getElementById("lmsp-output");
  var textEl = document.getElementById("lmsp-live-text");
  var initial = document.getElementById("lmsp-initial-text");
  if (!pane || !textEl) {
    return;
  }
  if (initial) {
    textEl.textContent = JSON.parse(initial.textContent);
  }
  textEl.scrollTop = textEl.scrollHeight;
  if (!pane.dataset.eventsUrl || !window.EventSource) {
    return;
  }
  var statusEl = document.getElementById("lmsp-live-status");
  var responseStatusEl = document.getElementById("lmsp-response-status");
  var noteEl = document.getElementById("lmsp-live-note");
  var cancelLink = document.getElementById("lmsp-cancel");
  var newest = parseInt(pane.dataset.cursor, 10);

  // Response event -> [task status, response status].
  var STATUS = {
    "response.in_progress": ["running", "in_progress"],
    "response.completed": ["succeeded", "completed"],
    "response.incomplete": ["succeeded", "incomplete"],
    "response.failed": ["failed", "failed"],
    "response.cancelled": ["cancelled", "cancelled"]
  };

  // Deltas arrive by the hundred per second: gather them and touch the DOM
  // once per frame, appending a text node (never re-setting the whole text).
  var pending = [];
  var pendingUpTo = newest;
  var scheduled = false;

  // data-cursor always names the last event the text on screen accounts for.
  function shown(id) {
    pane.dataset.cursor = String(id);
  }

  function flush() {
    scheduled = false;
    if (pending.length) {
      // Keep following the end unless the reader scrolled up.
      var following = textEl.scrollTop + textEl.clientHeight >= textEl.scrollHeight - 4;
      textEl.appendChild(document.createTextNode(pending.join("")));
      pending = [];
      shown(pendingUpTo);
      if (following) {
        textEl.scrollTop = textEl.scrollHeight;
      }
    }
  }

  function schedule() {
    if (!scheduled) {
      scheduled = true;
      if (window.requestAnimationFrame) {
        window.requestAnimationFrame(flush);
      } else {
        window.setTimeout(flush, 16);
      }
    }
  }

  function note(text) {
    if (noteEl) {
      noteEl.textContent = text;
    }
  }

  function fresh(event) {
    var id = parseInt(event.lastEventId, 10);
    if (isNaN(id) || id <= newest) {
      return false;
    }
    newest = id;
    return true;
  }

  var source = new EventSource(pane.dataset.eventsUrl);

  source.addEventListener("open", function () {
    note("live output: connected");
  });

  // A run that may call tools has several items: each after the first on a line of its own, a call
  // as "→ name(arguments)" with its arguments as they stream (the server renders the same).
  function append(text) {
    pending.push(text);
    pendingUpTo = newest;
    schedule();
  }

  source.addEventListener("response.output_item.added", function (event) {
    if (!fresh(event)) {
      return;
    }
    var data = JSON.parse(event.data);
    if (data.output_index === 0) {
      // A new attempt's first item: the earlier attempt's output was dropped.
      pending = [];
      textEl.textContent = "";
      shown(newest);
    } else {
      append("\n");
    }
    if (data.item.type === "function_call") {
      append("\u2192 " + data.item.name + "(");
    }
  });

  source.addEventListener("response.function_call_arguments.delta", function (event) {
    if (fresh(event)) {
      append(JSON.parse(event.data).delta);
    }
  });

  source.addEventListener("response.function_call_arguments.done", function (event) {
    if (fresh(event)) {
      append(")");
    }
  });

  source.addEventListener("response.output_text.delta", function (event) {
    if (fresh(event)) {
      pending.push(JSON.parse(event.data).delta);
      pendingUpTo = newest;
      schedule();
    }
  });

  // A requeue (the reaper, a worker's or an operator's hand-back): the attempt's output is dropped, and
  // the page reloads so that its attempts table shows the attempt that ended and why.
  source.addEventListener("response.queued", function (event) {
    if (!fresh(event)) {
      return;
    }
    pending = [];
    textEl.textContent = "";
    shown(newest);
    statusEl.textContent = "queued";
    statusEl.dataset.status = "queued";
    source.close();
    note("queued again; reloading the page");
    window.location.reload();
  });

  Object.keys(STATUS).forEach(function (type) {
    source.addEventListener(type, function (event) {
      if (!fresh(event)) {
        return;
      }
      flush();
      shown(newest);
      statusEl.textContent = STATUS[type][0];
      statusEl.dataset.status = STATUS[type][0];
      if (responseStatusEl) {
        responseStatusEl.textContent = STATUS[type][1];
      }
      if (type !== "response.in_progress") {
        source.close();
        note("finished; reloading the page");
        if (cancelLink) {
          cancelLink.hidden = true;
        }
        window.location.reload();
      }
    });
  });

  source.addEventListener("error", function () {
    if (source.readyState === EventSource.CLOSED) {
      note("live output stopped; reload the page");
    } else {
      note("live output: reconnecting…");
    }
  });
})();
