// The live page: streams a chat completion with attribution from this server and paints the prompt with the
// heat weights the server sends (the same viz._unit weights as Explanation.to_html(), coloured by heatmap.js);
// with an image (a vision-language model), the image too, cell by cell over its token grid.
const TOP_K = 5;
const $ = id => document.getElementById(id);
const state = { header: null, steps: [], cells: [], textPositions: [], imageCells: [], imageURL: null, pinned: null };
$("model").textContent = MODEL;

function logValue(v) { return v === null ? -Infinity : v; }

function topTokens(logC) {  // prompt indices of the TOP_K highest scores among the coloured text tokens
  const idx = [...state.textPositions];
  idx.sort((a, b) => logValue(logC[b]) - logValue(logC[a]) || a - b);
  return idx.slice(0, TOP_K);
}

function paint(k) {  // k: a step, or null for the whole answer (Explanation.scores)
  if (!state.header || !state.steps.length) return;
  const last = state.steps[state.steps.length - 1];
  const heat = k === null ? last.heat_mean : state.steps[k].heat;
  const logC = k === null ? last.whole_scores : state.steps[k].log_c;
  const name = k === null ? "whole-answer score = " : "log c = ";
  const shown = v => v === null ? "-inf" : v.toFixed(3);
  heat.forEach((w, j) => {
    const i = state.textPositions[j], cell = state.cells[i];
    cell.style.background = macsHeatColour(w);
    cell.title = name + shown(logC[i]);
  });
  state.imageCells.forEach((cells, m) => {  // each image's token grid: heat and scores row by row
    const grids = (k === null ? last : state.steps[k]).images[m];
    const weights = (k === null ? grids.heat_mean : grids.heat).flat();
    const scores = (k === null ? grids.whole_scores : grids.scores).flat();
    const label = k === null ? "whole-answer score = " : "score = ";
    cells.forEach((cell, j) => { cell.style.background = macsHeatColour(weights[j]); cell.title = label + shown(scores[j]); });
  });
  state.cells.forEach(c => c.classList.remove("top"));
  const top = topTokens(logC);
  top.forEach(i => state.cells[i].classList.add("top"));
  const box = $("prompt"), first = state.cells[top[0]];
  if (first && (first.offsetTop < box.scrollTop || first.offsetTop > box.scrollTop + box.clientHeight - 20))
    box.scrollTop = first.offsetTop - box.offsetTop - 20;
  const token = k === null ? "" : JSON.stringify(state.steps[k].token);
  $("caption").textContent = k === null ? "Prompt: whole answer" :
    `Prompt: step ${k} (${token})` + (state.pinned === k ? ", pinned" : "");
  document.body.dataset.view = k === null ? "mean" : String(k);
  $("mean").hidden = k === null;  // the caption already says "whole answer"
}

function showPrompt(header) {
  state.header = header;
  const box = $("prompt"), [start, end] = header.source_span;
  const inImages = new Set((header.images || []).flatMap(picture => picture.positions));
  box.textContent = "";
  state.textPositions = header.text_positions || header.input_tokens.map((_, i) => i).slice(start, end);
  state.cells = header.input_tokens.map((tok, i) => {
    const s = document.createElement("span");
    s.textContent = inImages.has(i) ? "" : tok;  // an image's tokens are drawn on the image
    s.className = i >= start && i < end ? "source" : "outside";
    box.appendChild(s);
    return s;
  });
  state.imageCells = (header.images || []).map(picture => macsImageGrid(picture, state.imageURL, $("pictures")));
}

function readImage(file) {  // a data URL, as the server takes image_url parts
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error("cannot read the image file"));
    reader.readAsDataURL(file);
  });
}

function addStep(attribution, piece) {
  const k = attribution.step;
  state.steps[k] = { ...attribution, token: piece };
  const s = document.createElement("span");
  s.textContent = piece;
  s.dataset.step = k;
  s.addEventListener("mouseenter", () => { if (state.pinned === null) paint(k); });
  s.addEventListener("mouseleave", () => { if (state.pinned === null) paint(null); });
  s.addEventListener("click", () => {
    $("answer").querySelectorAll("span").forEach(x => x.classList.remove("active"));
    if (state.pinned === k) { state.pinned = null; paint(null); return; }
    state.pinned = k; s.classList.add("active"); paint(k);
  });
  $("answer").appendChild(s);
  if (state.pinned === null) paint(k);  // follow the newest token while it streams
}

function request() {
  const question = $("question").value, context = $("context").value;
  const content = context.trim()
    ? QA_TEMPLATE.replace("{question}", () => question).replace("{context}", () => context) : question;
  const attribution = {
    alpha: Number($("alpha").value), pooling: $("pooling").value,
    redistribute: $("redistribute").checked, attention: $("attention").value,
  };
  // A prompt with an image has no source span: the image's tokens sit inside the user's message.
  if (context.trim() && !state.imageURL) attribution.source = context;
  const message = state.imageURL
    ? [{ type: "image_url", image_url: { url: state.imageURL } }, { type: "text", text: content }] : content;
  return { model: MODEL, messages: [{ role: "user", content: message }], stream: true,
           max_tokens: Number($("max_tokens").value), attribution };
}

async function ask(event) {
  event.preventDefault();
  Object.assign(state, { header: null, steps: [], cells: [], textPositions: [], imageCells: [], imageURL: null,
                        pinned: null });
  $("answer").textContent = ""; $("prompt").textContent = ""; $("pictures").textContent = "";
  $("status").textContent = "streaming"; $("send").disabled = true;
  try {
    const file = $("image").files[0];
    if (file) state.imageURL = await readImage(file);
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(request()) });
    if (!response.ok) throw new Error((await response.json()).error.message);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = chunk.choices[0], piece = (choice && choice.delta.content) || "";
        if (chunk.attribution && chunk.attribution.input_tokens) showPrompt(chunk.attribution);
        else if (chunk.attribution) addStep(chunk.attribution, piece);
        else if (piece)  // text held back until its character was complete
          ($("answer").lastChild || $("answer").appendChild(document.createElement("span"))).textContent += piece;
      }
    }
    if (state.pinned === null) paint(null);
    $("status").textContent = "done";
  } catch (error) {
    $("status").textContent = "error: " + error.message;
  } finally {
    $("send").disabled = false;
  }
}

$("ask").addEventListener("submit", ask);
$("mean").addEventListener("click", () => {
  state.pinned = null;
  $("answer").querySelectorAll("span").forEach(x => x.classList.remove("active"));
  paint(null);
});
