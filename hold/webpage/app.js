// hold web: the page's only script. Every piece of data (labels, commands,
// users: user-controlled) enters the DOM through textContent, never as HTML.
"use strict";

(() => {
  const POLL_MS = 2000; // status and audit
  const REPORT_MS = 30000; // the usage report changes slowly

  const $ = (id) => document.getElementById(id);

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  // cells: strings (or [text, class] pairs); all set as text
  function row(cells, cls) {
    const tr = el("tr", cls);
    for (const c of cells) {
      const [text, tdClass] = Array.isArray(c) ? c : [c, null];
      tr.append(el("td", tdClass, text === null || text === undefined ? "" : text));
    }
    return tr;
  }

  function fill(table, head, rows) {
    const hr = el("tr");
    for (const h of head) hr.append(el("th", null, h));
    const thead = el("thead");
    thead.append(hr);
    const tbody = el("tbody");
    tbody.append(...rows);
    table.replaceChildren(thead, tbody);
  }

  const pad = (n) => String(n).padStart(2, "0");

  function clock(epoch) {
    if (typeof epoch !== "number") return "";
    const d = new Date(epoch * 1000);
    const hms = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
    const today = new Date().toDateString() === d.toDateString();
    return today ? hms : `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${hms}`;
  }

  function span(seconds) {
    if (typeof seconds !== "number") return "-";
    let s = Math.max(0, Math.round(seconds));
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${pad(s % 60)}s`;
    s = Math.floor(s / 60);
    if (s < 1440) return `${Math.floor(s / 60)}h ${pad(s % 60)}m`;
    return `${Math.floor(s / 1440)}d ${Math.floor((s % 1440) / 60)}h`;
  }

  function size(n) {
    if (typeof n !== "number") return "-";
    if (n < 1024) return `${n}B`;
    let v = n;
    for (const unit of ["KiB", "MiB", "GiB"]) {
      v /= 1024;
      if (v < 1024 || unit === "GiB") return `${v.toFixed(1)}${unit}`;
    }
    return `${n}B`;
  }

  // A lease's usage (status.json): CPU now, CPU time, memory, processes; "-" unknown.
  function usageCells(u) {
    if (!u) return [["-", "num"], ["-", "num"], ["-", "num"], ["-", "num"]];
    const pct = typeof u.cpu_percent === "number" ? `${Math.round(u.cpu_percent)}%` : "-";
    return [[pct, "num"], [span(u.cpu_seconds), "num"], [size(u.rss_bytes), "num"],
      [u.pids, "num"]];
  }

  // An NVIDIA GPU's figures (NVML): "37% 1.2GiB/80.0GiB"; "" where there are none.
  function gpuText(g) {
    if (!g) return "";
    const util = typeof g.util_percent === "number" ? `${g.util_percent}%` : "-";
    return `${util} ${size(g.memory_used_bytes)}/${size(g.memory_total_bytes)}`;
  }

  const labelOf = (x) => (x.label === null || x.label === undefined ? "(private)" : x.label);

  function arbiterLine(arb) {
    if (!arb) return "arbiter: unknown";
    const kind = arb.kind === "system" ? "system daemon"
      : arb.kind === "shared" ? `shared daemon of ${arb.user}` : `per-user daemon of ${arb.user}`;
    return `arbiter: ${kind} (pid ${arb.pid}, ${arb.state_dir})`;
  }

  function deviceRows(status) {
    const now = Date.now() / 1000;
    const rows = [];
    for (const cls of Object.keys(status.classes).sort()) {
      const info = status.classes[cls];
      for (const dev of info.devices) {
        const h = dev.holder;
        const name = `${cls}:${dev.index}`;
        if (!h) {
          const blank = ["", "", "", "", "", "", "", "", ""]; // LEASE to UNTIL
          const known = dev.known || "free";
          rows.push(row([name, known, ...blank, [gpuText(dev.gpu), "num"], dev.proof || ""], known === "free" ? "free" : "unknown"));
          continue;
        }
        const state = h.state === "elsewhere" ? "active" : h.state;
        const timed = typeof h.since === "number" && typeof h.expires === "number";
        const since = timed ? `${clock(h.since)} (${span(now - h.since)} ago)` : "";
        const until = timed ? `${clock(h.expires)} (${span(h.expires - now)} left)` : "";
        const via = h.state === "elsewhere" ? " via another daemon" : "";
        const figures = "usage" in h ? usageCells(h.usage) : ["", "", "", ""];
        rows.push(row([name, state, [h.lease, "mono"], h.user, [h.pid, "num"], ...figures,
          since, until, [gpuText(dev.gpu), "num"], [labelOf(h) + via, "wrap"]], "held"));
      }
      info.queue.forEach((w, n) => {
        const what = w.indices && w.indices.length ? w.indices.join(",") : `${w.count} device(s)`;
        rows.push(row([cls, `queue ${n + 1}`, "", w.user, [w.pid, "num"], "", "", "", "", "", "",
          "", [`${labelOf(w)} wants ${what}`, "wrap"]], "queue"));
      });
    }
    return rows;
  }

  function holderRows(audit) {
    return audit.holders.map((r) => {
      let lease;
      if (!r.covered) lease = `STRAY: ${r.why}`;
      else if (r.lease) lease = `${r.lease} '${r.label}'`;
      else lease = "allowed (configuration)";
      const device = r.index === null ? `${r.device}: shared nodes only` : r.device;
      return row([device, [r.pid, "num"], r.user, span(r.age_s), [size(r.rss_bytes), "num"],
        [size(r.device_memory_bytes), "num"], [lease, r.covered ? "wrap" : "wrap why"],
        [r.command, "mono wrap"]], r.covered ? "covered" : "stray");
    });
  }

  async function getJSON(path) {
    const res = await fetch(path, { cache: "no-store" });
    const doc = await res.json().catch(() => ({ error: `${res.status} ${res.statusText}` }));
    return { ok: res.ok, status: res.status, doc };
  }

  function showError(text) {
    const e = $("error");
    e.textContent = text || "";
    e.hidden = !text;
  }

  async function refresh() {
    const errors = [];
    try {
      const [st, au] = await Promise.all([getJSON("/status.json"), getJSON("/audit.json")]);
      if (st.ok) {
        $("arbiter").textContent = arbiterLine(st.doc.arbiter);
        fill($("devices"), ["DEVICE", "STATE", "LEASE", "USER", "PID", "CPU%", "CPU", "MEM",
          "PROCS", "SINCE", "UNTIL", "GPU", "LABEL"], deviceRows(st.doc));
      } else errors.push(`status: ${st.doc.error}`);
      if (au.ok) {
        fill($("holders"), ["DEVICE", "PID", "USER", "AGE", "RSS", "DEVMEM", "LEASE",
          "COMMAND"], holderRows(au.doc));
        let tail = `${au.doc.holders.length} holder(s), ${au.doc.stray} stray; ` +
          `${au.doc.processes} processes scanned`;
        if (au.doc.not_inspected) tail += `; not inspected: ${au.doc.not_inspected} (permission)`;
        $("holders-summary").textContent = tail;
      } else errors.push(`audit: ${au.doc.error}`);
      $("updated").textContent = `updated ${clock(Date.now() / 1000)}`;
    } catch (e) {
      errors.push(`hold web does not answer (${e})`);
    }
    showError(errors.join("; "));
    setTimeout(refresh, POLL_MS);
  }

  // hold report --json: each list as a table, hold report's columns first,
  // seconds (keys ending in _s) as durations.
  const REPORT_TITLES = { users: "per user", devices: "per device", strays: "strays seen" };
  const REPORT_FIRST = ["user", "device", "seen", "pid", "leases", "leased_s", "held_s",
    "cpu_s", "peak_bytes", "wait_median_s", "wait_max_s", "expiries", "releases", "strays", "labels"];

  // Headers shorter than the key's words (the table must fit the page).
  const REPORT_HEADS = { peak_bytes: "PEAK MEM", cpu_unmeasured: "NO CPU" };

  function reportCell(key, v) {
    if (v === null || v === undefined) return "-";
    if (typeof v === "number" && key.endsWith("_s")) return span(v);
    if (typeof v === "number" && key.endsWith("_bytes")) return size(v);
    if (typeof v === "number" && key === "seen") return clock(v);
    if (typeof v !== "object") return String(v);
    const num = key === "labels" ? span : String; // labels: seconds leased under each
    const part = ([k, x]) => `${k} ${typeof x === "number" ? num(x) : JSON.stringify(x)}`;
    return Object.entries(v).map(part).join(", ");
  }

  function reportTable(list) {
    const keys = [...new Set(list.flatMap((x) => Object.keys(x)))];
    const cols = [...REPORT_FIRST.filter((k) => keys.includes(k)),
      ...keys.filter((k) => !REPORT_FIRST.includes(k))];
    const t = el("table");
    const wide = (c) => (c === "labels" || c === "command" || c === "ends" ? "wrap" : "");
    const head = (c) => REPORT_HEADS[c] || c.replace(/_s$/, "").replace(/_/g, " ").toUpperCase();
    fill(t, cols.map(head),
      list.map((x) => row(cols.map((c) => [reportCell(c, x[c]), wide(c)]))));
    return t;
  }

  function renderReport(doc) {
    const from = doc.since ? clock(doc.since) : "the start";
    const out = [el("p", "summary",
      `from ${from} to ${clock(doc.now)} (device time; held: seen in use; ` +
      "CPU and peak memory: their processes)")];
    const known = Object.keys(REPORT_TITLES).filter((k) => k in doc);
    for (const key of [...known, ...Object.keys(doc).filter((k) => !known.includes(k))]) {
      const list = doc[key];
      if (!Array.isArray(list) || !list.every((x) => x && typeof x === "object")) continue;
      out.push(el("h3", null, REPORT_TITLES[key] || key));
      out.push(list.length ? reportTable(list) : el("p", "summary", "none"));
    }
    return out;
  }

  async function refreshReport() {
    try {
      const rep = await getJSON("/report.json");
      const box = $("report");
      if (rep.ok) box.replaceChildren(...renderReport(rep.doc));
      else box.replaceChildren(el("p", "summary", `report: ${rep.doc.error}`));
    } catch (e) {
      $("report").replaceChildren(el("p", "summary", `report: ${e}`));
    }
    setTimeout(refreshReport, REPORT_MS);
  }

  refresh();
  refreshReport();
})();
