/* qkv explore: the page. Plain JavaScript, SVG and canvas; no library, no build step, no network besides
   this page's own /api (and none at all in an exported page, whose data is in window.QKV_EXPORT).

   Data (the JSON of qkv/explore/analysis.py):
     info        the model (family, kind, layers, heads, what input it takes)
     analysis    {tokens: {role: labels}, views: [{name, queries, keys, causal, layers[L][H][Tq][Tk], stats}]}
     generation  {prefix, steps: [{token, label, rows: {self|cross: [L][H][Tk]}, top, cache}], cache}
     positions   {encodings: [{where, kind, table?, similarity?, cos?, dot_by_distance?, slopes?, bias?}]}
*/
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const SVGNS = "http://www.w3.org/2000/svg";
  const LINE_MIN = 0.02;  // the lines view draws pairs with weight >= this (the heat map draws every cell)
  const EXPORTED = window.QKV_EXPORT || null;
  const state = { info: null, analysis: null, generation: null, positions: null,
                  view: 0, layer: 0, head: 0, query: 0, step: 0 };
  window.QKV = state;  // for the curious (and the browser tests): the data the page draws

  // -- small helpers ------------------------------------------------------------------------------------
  function svgEl(tag, attrs, parent) {
    const e = document.createElementNS(SVGNS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function option(select, value, text) {
    const o = document.createElement("option");
    o.value = value; o.textContent = text; select.appendChild(o);
  }
  function fill(select, n, prefix, keep) {
    const old = keep && select.value !== "" ? Number(select.value) : null;
    clear(select);
    for (let i = 0; i < n; i++) option(select, i, prefix + i);
    if (old !== null && old < n) select.value = old;
  }
  function bytes(n) {
    if (n >= 1 << 20) return (n / (1 << 20)).toFixed(2) + " MiB";
    if (n >= 1024) return (n / 1024).toFixed(1) + " KiB";
    return n + " B";
  }
  function showError(msg) { const e = $("error"); e.textContent = msg; e.hidden = !msg; }
  function status(msg) { $("status").textContent = msg || ""; }

  // viridis, 9 stops: sequential colour for probabilities in [0, 1]
  const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
                   [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];
  function viridisRGB(p) {
    const x = Math.max(0, Math.min(1, p)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(x)), f = x - i, a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return [0, 1, 2].map((c) => Math.round(a[c] + f * (b[c] - a[c])));
  }
  // blue - white - red for signed values (position tables), v in [-1, 1]
  function divergingRGB(v) {
    const t = Math.max(-1, Math.min(1, v));
    return [t < 0 ? 255 + t * 200 : 255, 255 - Math.abs(t) * 200, t > 0 ? 255 - t * 200 : 255].map(Math.round);
  }
  const css = (rgb) => "rgb(" + rgb.join(",") + ")";
  const viridis = (p) => css(viridisRGB(p));
  // a matrix as a canvas: one pixel per entry (ImageData, fast for thousands of thumbnails' cells), shown
  // `cell` x `cellHeight` screen pixels per entry; rgb(value) -> [r, g, b]
  function matrixCanvas(m, cell, rgb, cellHeight) {
    const c = document.createElement("canvas");
    const rows = m.length, cols = m[0].length;
    c.width = cols; c.height = rows;
    const img = new ImageData(cols, rows), d = img.data;
    for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) {
      const k = 4 * (i * cols + j), v = rgb(m[i][j]);
      d[k] = v[0]; d[k + 1] = v[1]; d[k + 2] = v[2]; d[k + 3] = 255;
    }
    c.getContext("2d").putImageData(img, 0, 0);
    c.style.width = cols * cell + "px"; c.style.height = rows * (cellHeight || cell) + "px";
    return c;
  }

  // -- talking to the server ----------------------------------------------------------------------------
  async function api(path, body) {
    const res = await fetch("api/" + path, body === undefined ? {} :
      { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    let data;
    try { data = await res.json(); } catch (e) { throw new Error("the server answered " + res.status + " without JSON"); }
    if (!res.ok) throw new Error(data.error || ("HTTP " + res.status));
    return data;
  }
  function wavBase64() {
    const f = $("wav").files[0];
    if (!f) return Promise.resolve(null);
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(String(r.result).split(",")[1]);
      r.onerror = () => reject(new Error("could not read " + f.name));
      r.readAsDataURL(f);
    });
  }
  async function request() {
    return { input: $("input").value, target: $("target").value || null,
             image: Number($("image").value || 0), wav: await wavBase64() };
  }

  async function analyze(ev) {
    if (ev) ev.preventDefault();
    showError(""); status("running the model…");
    try {
      state.analysis = await api("analyze", await request());
      state.query = 0;
      showTab("attention");
      renderAnalysis();
      status("");
    } catch (e) { state.analysis = null; renderAnalysis(); showError(e.message); status(""); }
  }

  async function generate() {
    showError(""); status("generating…");
    try {
      const body = await request();
      Object.assign(body, { max_new_tokens: Number($("max-new").value), do_sample: $("sample").checked,
        temperature: Number($("temperature").value), seed: Number($("seed").value),
        block_size: Number($("block-size").value) });
      state.generation = await api("generate", body);
      state.step = 0;
      showTab("generation");
      renderGeneration();
      status("");
    } catch (e) { showError(e.message); status(""); }
  }

  function showTab(name) {
    for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("on", b.dataset.tab === name);
    for (const s of document.querySelectorAll(".tab")) s.hidden = s.id !== name + "-tab";
    if (name === "positions") renderPositions();
  }

  // -- the model header and the form ---------------------------------------------------------------------
  function renderInfo() {
    const i = state.info;
    const layers = Object.entries(i.layers).map(([k, v]) => v + " " + k).join(" + ");
    $("model").textContent = i.name + ": " + i.class + " (" + i.kind + "), " + layers + " layers, " + i.n_heads +
      " heads, d_model " + i.d_model + ", " + i.position + " positions, " + i.parameters.toLocaleString() +
      " parameters, context " + i.context;
    const label = { text: "Input text", ids: "Token ids", image: "", audio: "Digits",
                    "text+image": "Question" }[i.input];
    $("input-label").textContent = label;
    $("text-row").hidden = i.input === "image" || (i.input === "audio" && !i.renders_text);
    $("target-row").hidden = !(i.kind === "seq2seq" || i.kind === "audio");
    $("image-row").hidden = i.input !== "image" && i.input !== "text+image";
    $("wav-row").hidden = i.input !== "audio";
    fill($("image"), i.images, "image ");
    $("gen-controls").hidden = !i.can_generate;
    $("max-new").max = i.max_new_tokens;
    if (i.input === "ids") $("input").placeholder = "no tokenizer in this folder: token ids, e.g. 5 3 9";
  }

  // -- attention ----------------------------------------------------------------------------------------
  function currentView() { return state.analysis ? state.analysis.views[state.view] : null; }

  function renderAnalysis() {
    const a = state.analysis;
    clear($("tokens")); clear($("overview")); clear($("heatmap")); clear($("lines")); clear($("stats"));
    clear($("view"));
    $("image-fig").hidden = true;
    if (!a) return;
    a.views.forEach((v, i) => option($("view"), i, v.name + (v.causal ? " (causal)" : "")));
    state.view = Math.min(state.view, a.views.length - 1);
    $("view").value = state.view;
    for (const role in a.tokens) {
      const div = document.createElement("div"); div.className = "role";
      const b = document.createElement("b"); b.textContent = role; div.appendChild(b);
      a.tokens[role].forEach((t, i) => {
        const s = document.createElement("span"); s.className = "tok"; s.textContent = t;
        s.dataset.role = role; s.dataset.i = i; s.title = role + " token " + i; div.appendChild(s);
      });
      $("tokens").appendChild(div);
    }
    renderView();
  }

  function renderView() {
    const v = currentView();
    if (!v) return;
    fill($("layer"), v.layers.length, "", true);
    fill($("head"), v.layers[0].length, "", true);
    state.layer = Math.min(state.layer, v.layers.length - 1);
    state.head = Math.min(state.head, v.layers[0].length - 1);
    $("layer").value = state.layer; $("head").value = state.head;
    renderOverview(); renderHead();
  }

  function statOf(v, layer, head) { return v.stats.find((s) => s.layer === layer && s.head === head); }

  function renderOverview() {
    const v = currentView(), box = $("overview");
    clear(box);
    const H = v.layers[0].length;
    box.style.gridTemplateColumns = "repeat(" + H + ", auto)";
    v.layers.forEach((heads, l) => heads.forEach((m, h) => {
      const d = document.createElement("div");
      d.className = "thumb" + (l === state.layer && h === state.head ? " sel" : "");
      const n = Math.max(m.length, m[0].length);
      d.appendChild(matrixCanvas(m, 72 / n, viridisRGB));
      const s = statOf(v, l, h), cap = document.createElement("div");
      cap.textContent = "L" + l + " H" + h + (s && s.entropy_nats !== null ? " · " + s.entropy_nats.toFixed(2) : "");
      if (s && s.flag) { const f = document.createElement("span"); f.className = "flag"; f.textContent = " " + s.flag; cap.appendChild(f); }
      d.appendChild(cap);
      d.title = "layer " + l + ", head " + h + (s ? ", entropy " + s.entropy_nats + " nats" : "");
      d.onclick = () => { state.layer = l; state.head = h; renderView(); };
      box.appendChild(d);
    }));
  }

  function renderHead() {
    const v = currentView(), a = state.analysis;
    const m = v.layers[state.layer][state.head];
    const ql = a.tokens[v.queries], kl = a.tokens[v.keys];
    for (const t of document.querySelectorAll("#overview .thumb"))
      t.classList.remove("sel");
    const thumbs = document.querySelectorAll("#overview .thumb");
    const sel = thumbs[state.layer * v.layers[0].length + state.head];
    if (sel) sel.classList.add("sel");
    const s = statOf(v, state.layer, state.head);
    $("flag-note").textContent = s && s.flag ? "this head is " + s.flag + " (mean max p " + s.max_prob +
      ", entropy " + s.entropy + " of the maximum)" : "";
    drawHeatmap(m, ql, kl);
    drawLines(m, ql, kl);
    drawImage();
    drawStats(v);
  }

  function drawHeatmap(m, ql, kl) {
    const svg = $("heatmap"); clear(svg);
    const tq = m.length, tk = m[0].length;
    const cell = Math.max(3, Math.min(26, Math.floor(520 / Math.max(tq, tk))));
    const labels = cell >= 9, pad = labels ? 70 : 4;
    svg.setAttribute("width", pad + tk * cell + 4); svg.setAttribute("height", pad + tq * cell + 4);
    const g = svgEl("g", { transform: "translate(" + pad + "," + pad + ")" }, svg);
    for (let i = 0; i < tq; i++) for (let j = 0; j < tk; j++) {
      const r = svgEl("rect", { x: j * cell, y: i * cell, width: cell, height: cell, fill: viridis(m[i][j]),
                                class: "cell", "data-q": i, "data-k": j }, g);
      svgEl("title", {}, r).textContent = ql[i] + " → " + kl[j] + ": " + m[i][j].toFixed(4);
    }
    if (!labels) return;
    ql.forEach((t, i) => { const e = svgEl("text", { x: -4, y: i * cell + cell * 0.7, "text-anchor": "end" }, g); e.textContent = t; });
    kl.forEach((t, j) => {
      const e = svgEl("text", { transform: "translate(" + (j * cell + cell * 0.7) + ",-4) rotate(-60)" }, g);
      e.textContent = t;
    });
  }

  function drawLines(m, ql, kl) {
    const svg = $("lines"); clear(svg);
    const n = Math.max(ql.length, kl.length), row = n > 48 ? 11 : 18, w = 330, left = 90, right = w - 90;
    svg.setAttribute("width", w); svg.setAttribute("height", n * row + 10);
    const y = (i) => 8 + i * row + row / 2;
    const lines = svgEl("g", {}, svg);
    for (let i = 0; i < m.length; i++) for (let j = 0; j < m[i].length; j++) {
      if (m[i][j] < LINE_MIN) continue;
      svgEl("line", { x1: left + 4, y1: y(i), x2: right - 4, y2: y(j), "stroke-width": 2,
                      "stroke-opacity": m[i][j].toFixed(3), class: "line", "data-q": i, "data-k": j }, lines);
    }
    const hover = (side, i, on) => {
      for (const l of svg.querySelectorAll(".line")) {
        const mine = Number(l.dataset[side]) === i;
        l.classList.toggle("active", on && mine); l.classList.toggle("dim", on && !mine);
      }
      for (const c of document.querySelectorAll("#heatmap .cell"))
        c.classList.toggle("hl", on && Number(c.dataset[side]) === i);
      for (const t of svg.querySelectorAll("text")) t.classList.remove("hl");
      const role = side === "q" ? currentView().queries : currentView().keys;
      for (const t of document.querySelectorAll("#tokens .tok"))
        t.classList.toggle("hl", on && t.dataset.role === role && Number(t.dataset.i) === i);
      if (on) {
        svg.querySelector("text." + side + "-tok[data-i='" + i + "']").classList.add("hl");
        if (side === "q") { state.query = i; drawImage(); }
      }
    };
    const tokens = (labels, side, x, anchor) => labels.forEach((t, i) => {
      const e = svgEl("text", { x: x, y: y(i) + 4, "text-anchor": anchor, class: side + "-tok", "data-i": i }, svg);
      e.textContent = t;
      e.addEventListener("mouseenter", () => hover(side, i, true));
      e.addEventListener("mouseleave", () => hover(side, i, false));
    });
    tokens(ql, "q", left, "end");
    tokens(kl, "k", right, "start");
  }

  // ViT: the attention of one query (the class token, or the patch hovered in the lines view) over the image;
  // a vision-language model: of the query that chose one answer token, on the image's placeholder positions
  function drawImage() {
    const a = state.analysis, v = currentView();
    if (!a || !a.image || !v) { $("image-fig").hidden = true; return; }
    const im = a.image, cv = $("image-canvas"), g = cv.getContext("2d");
    $("image-fig").hidden = false;
    const H = im.pixels.length, W = im.pixels[0].length, scale = Math.max(1, Math.floor(256 / Math.max(H, W)));
    cv.width = W * scale; cv.height = H * scale;
    for (let i = 0; i < H; i++) for (let j = 0; j < W; j++) {
      const p = im.pixels[i][j];
      g.fillStyle = "rgb(" + p.map((x) => Math.round(255 * x)).join(",") + ")";
      g.fillRect(j * scale, i * scale, scale, scale);
    }
    const row = v.layers[state.layer][state.head][state.query];
    const off = im.offset !== undefined ? im.offset : (im.cls ? 1 : 0);
    const patches = row.slice(off, off + im.grid[0] * im.grid[1]), top = Math.max.apply(null, patches) || 1, ps = im.patch_size * scale;
    patches.forEach((p, k) => {
      const r = Math.floor(k / im.grid[1]), c = k % im.grid[1];
      g.fillStyle = "rgba(255,90,0," + (0.75 * p / top).toFixed(3) + ")";
      g.fillRect(c * ps, r * ps, ps, ps);
    });
    const where = " (layer " + state.layer + ", head " + state.head + ").";
    if (im.offset !== undefined) {
      $("image-caption").textContent = im.caption + "; answer: " + a.tokens.answer.join(" ") + " (" +
        Math.round(100 * im.image_share) + "% of the answer's attention on the image, mean over layers and " +
        "heads). Orange: where the query that chose '" + a.tokens.answer[state.query] + "' looks" + where;
      return;
    }
    const who = im.cls && state.query === 0 ? "the class token" : "patch " + a.tokens.input[state.query];
    $("image-caption").textContent = im.caption + "; predicted class " + im.prediction + " (p " + im.confidence +
      "). Orange: where " + who + " looks" + where;
  }

  function drawStats(v) {
    const t = $("stats"); clear(t);
    const head = t.insertRow();
    ["layer", "head", "entropy (nats)", "entropy / log n", "mean max p", "flag"].forEach((h) => {
      const th = document.createElement("th"); th.textContent = h; head.appendChild(th);
    });
    v.stats.filter((s) => s.layer === state.layer).forEach((s) => {
      const r = t.insertRow();
      if (s.head === state.head) r.className = "sel";
      [s.layer, s.head, s.entropy_nats, s.entropy, s.max_prob, s.flag].forEach((x) => {
        r.insertCell().textContent = x === null ? "–" : x;
      });
    });
  }

  // -- generation step by step ----------------------------------------------------------------------------
  function renderGeneration() {
    const g = state.generation;
    $("gen-body").hidden = !g || !!g.error;
    $("gen-empty").hidden = !!g && !g.error;
    if (g && g.error) { $("gen-empty").textContent = g.error; return; }
    if (!g) return;
    $("step").max = g.steps.length - 1;
    $("step").value = state.step;
    const L = g.steps[0].rows.self.length, H = g.steps[0].rows.self[0].length;
    fill($("gen-layer"), L, "", true); fill($("gen-head"), H, "", true);
    renderStep();
  }

  function renderStep() {
    const g = state.generation, s = g.steps[state.step];
    const layer = Number($("gen-layer").value || 0), head = Number($("gen-head").value || 0);
    $("step-label").textContent = "step " + state.step + " of " + (g.steps.length - 1) + ": token " +
      JSON.stringify(s.label) + " (id " + s.token + ")";
    const box = $("gen-tokens"); clear(box);
    if (g.source) {
      const d = document.createElement("div"); d.className = "role";
      d.innerHTML = "<b>source</b>";
      g.source.forEach((t) => { const e = document.createElement("span"); e.className = "tok"; e.textContent = t; d.appendChild(e); });
      box.appendChild(d);
    }
    const d = document.createElement("div"); d.className = "role"; d.innerHTML = "<b>sequence</b>";
    g.prefix.forEach((t) => { const e = document.createElement("span"); e.className = "tok"; e.textContent = t; d.appendChild(e); });
    g.steps.forEach((st, i) => {
      const e = document.createElement("span");
      e.className = "tok gen" + (i === state.step ? " now" : ""); e.textContent = st.label;
      e.title = "step " + i; e.style.opacity = i > state.step ? 0.35 : 1;
      e.onclick = () => { state.step = i; $("step").value = i; renderStep(); };
      d.appendChild(e);
    });
    box.appendChild(d);
    // the row: keys = prefix + tokens generated before this step (the cache), and the source for cross
    const keys = g.prefix.concat(g.steps.slice(0, state.step).map((x) => x.label));
    const svg = $("gen-row"); clear(svg);
    let y = 0;
    const bars = (title, labels, row) => {
      const e = svgEl("text", { x: 0, y: y + 12 }, svg); e.textContent = title; y += 18;
      row.forEach((p, j) => {
        const t = svgEl("text", { x: 70, y: y + 10, "text-anchor": "end" }, svg); t.textContent = labels[j];
        svgEl("rect", { x: 74, y: y + 1, width: Math.max(0.5, 200 * p), height: 10, fill: viridis(p), class: "bar" }, svg);
        const v = svgEl("text", { x: 78 + 200 * p, y: y + 10 }, svg); v.textContent = p.toFixed(3);
        y += 13;
      });
      y += 8;
    };
    bars("self-attention over the cache", keys, s.rows.self[layer][head]);
    if (s.rows.cross) bars("cross-attention over the source", g.source || [], s.rows.cross[layer][head]);
    svg.setAttribute("width", 330); svg.setAttribute("height", y);
    // top 10
    const top = $("gen-top"); clear(top);
    s.top.forEach((c, i) => {
      const yy = i * 18;
      const t = svgEl("text", { x: 80, y: yy + 13, "text-anchor": "end" }, top); t.textContent = JSON.stringify(c.label);
      svgEl("rect", { x: 84, y: yy + 3, width: Math.max(0.5, 200 * c.p), height: 13,
                      fill: c.id === s.token ? "#d9480f" : "#6b8fd6" }, top);
      const v = svgEl("text", { x: 88 + 200 * c.p, y: yy + 13 }, top); v.textContent = c.p.toFixed(4);
    });
    top.setAttribute("width", 340); top.setAttribute("height", s.top.length * 18 + 4);
    drawCache();
  }

  function drawCache() {
    const g = state.generation, svg = $("gen-cache"); clear(svg);
    const W = 360, H = 230, l = 64, b = 24, t = 52;
    svg.setAttribute("width", W); svg.setAttribute("height", H);
    const st = g.steps, n = st.length;
    const maxY = Math.max.apply(null, st.map((s) => Math.max(s.cache.static_per_layer, s.cache.paged_per_layer, s.cache.used_per_layer)));
    const x = (i) => l + (n === 1 ? 0 : i * (W - l - 10) / (n - 1)), y = (v) => H - b - v * (H - b - t) / maxY;
    const series = [["static_per_layer", "#888", "static (allocated)"], ["paged_per_layer", "#1f77b4", "paged (blocks in use)"],
                    ["used_per_layer", "#d9480f", "used (positions)"]];
    series.forEach(([key, color, name], k) => {
      const pts = st.map((s, i) => x(i) + "," + y(s.cache[key])).join(" ");
      svgEl("polyline", { points: pts, fill: "none", stroke: color, "stroke-width": 2, class: "series-" + key }, svg);
      svgEl("rect", { x: l + 4, y: 6 + k * 14, width: 10, height: 4, fill: color }, svg);
      const t = svgEl("text", { x: l + 18, y: 11 + k * 14, class: "legend" }, svg); t.textContent = name;
    });
    svgEl("line", { x1: x(state.step), x2: x(state.step), y1: t, y2: H - b, stroke: "#222", "stroke-dasharray": "3,3" }, svg);
    const t0 = svgEl("text", { x: l - 4, y: y(maxY) + 4, "text-anchor": "end" }, svg); t0.textContent = bytes(maxY);
    const t1 = svgEl("text", { x: l - 4, y: H - b, "text-anchor": "end" }, svg); t1.textContent = "0";
    const t2 = svgEl("text", { x: W / 2, y: H - 6, "text-anchor": "middle" }, svg); t2.textContent = "step";
    const c = st[state.step].cache, s = g.cache;
    $("cache-note").textContent = "After step " + state.step + ": " + c.positions + " positions cached. Per layer: used " +
      bytes(c.used_per_layer) + " (= 2 × " + s.n_kv_heads + " kv heads × " + s.head_dim + " dims × " + c.positions +
      " positions × " + s.dtype_bytes + " bytes), paged " + c.paged_blocks + " block(s) of " + s.block_size + " = " +
      bytes(c.paged_per_layer) + ", static " + bytes(c.static_per_layer) + " allocated up front for " +
      s.static_positions + " positions. " + s.n_layers + " layers" +
      (s.cross_bytes ? "; cross-attention K/V of the source: " + bytes(s.cross_bytes / s.n_layers) + " per layer, fixed." : ".");
  }

  // -- positional encodings -------------------------------------------------------------------------------
  function renderPositions() {
    if (state.positions) return draw();
    if (EXPORTED) return;
    api("positions").then((p) => { state.positions = p; draw(); }).catch((e) => showError(e.message));
    function draw() {
      const box = $("positions"); clear(box);
      state.positions.encodings.forEach((e) => box.appendChild(encodingPictures(e)));
    }
  }

  function figure(caption, node) {
    const f = document.createElement("figure"), c = document.createElement("figcaption");
    c.textContent = caption; f.appendChild(c); f.appendChild(node); return f;
  }

  function encodingPictures(e) {
    const div = document.createElement("div"); div.className = "enc";
    const h = document.createElement("h3"); h.textContent = e.where + ": " + e.kind; div.appendChild(h);
    const pics = document.createElement("div"); pics.className = "pics"; div.appendChild(pics);
    if (e.kind === "none") {
      const p = document.createElement("p");
      p.textContent = "No positional encoding: without the causal mask, attention would see a bag of tokens.";
      div.appendChild(p);
    }
    if (e.table) {
      const top = Math.max.apply(null, e.table.map((r) => Math.max.apply(null, r.map(Math.abs)))) || 1;
      const cell = Math.max(1, Math.min(4, Math.floor(512 / e.table[0].length)));
      pics.appendChild(figure("table: position (down, " + e.table.length + " of " + e.n_positions + ") × dimension (across, " +
        e.table[0].length + " of " + e.d_model + "); blue < 0 < red",
        matrixCanvas(e.table, cell, (v) => divergingRGB(v / top), Math.max(1, Math.min(8, Math.floor(256 / e.table.length))))));
      pics.appendChild(figure("cosine similarity between positions (1 = yellow)",
        matrixCanvas(e.similarity, Math.max(1, Math.floor(256 / e.similarity.length)), (v) => viridisRGB((v + 1) / 2))));
    }
    if (e.kind === "rope") {
      pics.appendChild(figure("cos(m·θᵢ): position m (down) × frequency pair i (across); head_dim " + e.head_dim +
        ", base " + e.base, matrixCanvas(e.cos, 4, divergingRGB)));
      pics.appendChild(figure("q_m · k_0 for q = k = all ones, rotated by the model's RoPE: it depends on distance only",
        lineChart(e.dot_by_distance, "distance m")));
    }
    if (e.kind === "alibi") {
      pics.appendChild(figure("slope per head (bias = −slope × distance)", barChart(e.slopes, "head ")));
      const lo = Math.min.apply(null, e.bias.map((m) => Math.min.apply(null, m.map((r) => Math.min.apply(null, r))))) || -1;
      e.bias.forEach((m, hh) => pics.appendChild(figure("head " + hh, matrixCanvas(m, 5, (v) => viridisRGB(1 - v / lo)))));
    }
    return div;
  }

  function lineChart(values, xlabel) {
    const svg = svgEl("svg", { width: 320, height: 160 });
    const lo = Math.min.apply(null, values), hi = Math.max.apply(null, values), n = values.length;
    const x = (i) => 30 + i * 280 / Math.max(1, n - 1), y = (v) => 140 - (v - lo) * 130 / ((hi - lo) || 1);
    svgEl("polyline", { points: values.map((v, i) => x(i) + "," + y(v)).join(" "), fill: "none", stroke: "#1f5fbf", "stroke-width": 2 }, svg);
    svgEl("line", { x1: 30, x2: 310, y1: y(0), y2: y(0), stroke: "#bbb" }, svg);
    const t = svgEl("text", { x: 170, y: 157, "text-anchor": "middle" }, svg); t.textContent = xlabel + " (0.." + (n - 1) + ")";
    return svg;
  }

  function barChart(values, prefix) {
    const svg = svgEl("svg", { width: 300, height: values.length * 16 + 4 });
    const hi = Math.max.apply(null, values) || 1;
    values.forEach((v, i) => {
      const t = svgEl("text", { x: 56, y: i * 16 + 12, "text-anchor": "end" }, svg); t.textContent = prefix + i;
      svgEl("rect", { x: 60, y: i * 16 + 3, width: 180 * v / hi, height: 11, fill: "#6b8fd6" }, svg);
      const u = svgEl("text", { x: 64 + 180 * v / hi, y: i * 16 + 12 }, svg); u.textContent = v.toPrecision(3);
    });
    return svg;
  }

  // -- start --------------------------------------------------------------------------------------------
  $("form").addEventListener("submit", analyze);
  $("generate").addEventListener("click", generate);
  for (const b of document.querySelectorAll("#tabs button")) b.addEventListener("click", () => showTab(b.dataset.tab));
  $("view").addEventListener("change", () => { state.view = Number($("view").value); state.query = 0; renderView(); });
  $("layer").addEventListener("change", () => { state.layer = Number($("layer").value); renderView(); });
  $("head").addEventListener("change", () => { state.head = Number($("head").value); renderView(); });
  $("step").addEventListener("input", () => { state.step = Number($("step").value); renderStep(); });
  $("gen-layer").addEventListener("change", renderStep);
  $("gen-head").addEventListener("change", renderStep);

  if (EXPORTED) {
    // an exported page: the data of one input, no server; the controls that would ask one are disabled
    Object.assign(state, { info: EXPORTED.info, analysis: EXPORTED.analysis, generation: EXPORTED.generation,
                           positions: EXPORTED.positions });
    renderInfo();
    $("input").value = EXPORTED.input || ""; $("target").value = EXPORTED.target || "";
    $("image").value = EXPORTED.image || 0;
    for (const id of ["input", "target", "image", "wav", "analyze", "generate", "max-new", "sample", "temperature", "seed", "block-size"])
      $(id).disabled = true;
    $("gen-controls").hidden = true;
    status("Exported page: the data of one input, no server. Run `qkv explore MODEL` to try other inputs.");
    renderAnalysis();
    renderGeneration();
  } else {
    api("info").then((i) => { state.info = i; renderInfo(); }).catch((e) => showError(e.message));
  }
})();
