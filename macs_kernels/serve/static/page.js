// The live page: streams a chat completion with attribution from this server and paints the prompt with the
// heat weights the server sends (the same viz._unit weights as Explanation.to_html(), coloured by heatmap.js).
const TOP_K = 5;
const $ = id => document.getElementById(id);
const state = { header: null, steps: [], cells: [], pinned: null };
$("model").textContent = MODEL;

function logValue(v) { return v === null ? -Infinity : v; }

function topTokens(logC) {  // prompt indices of the TOP_K highest scores inside the source span
  const [start, end] = state.header.source_span;
  const idx = [];
  for (let i = start; i < end; i++) idx.push(i);
  idx.sort((a, b) => logValue(logC[b]) - logValue(logC[a]) || a - b);
  return idx.slice(0, TOP_K);
}

function paint(k) {  // k: a step, or null for the whole answer (Explanation.scores)
  if (!state.header || !state.steps.length) return;
  const [start] = state.header.source_span;
  const last = state.steps[state.steps.length - 1];
  const heat = k === null ? last.heat_mean : state.steps[k].heat;
  const logC = k === null ? last.whole_scores : state.steps[k].log_c;
  const name = k === null ? "whole-answer score = " : "log c = ";
  heat.forEach((w, i) => {
    const cell = state.cells[start + i];
    cell.style.background = macsHeatColour(w);
    cell.title = name + (logC[start + i] === null ? "-inf" : logC[start + i].toFixed(3));
  });
  state.cells.forEach(c => c.classList.remove("top"));
  const top = topTokens(logC);
  top.forEach(i => state.cells[i].classList.add("top"));
  const box = $("prompt"), first = state.cells[top[0]];
  if (first.offsetTop < box.scrollTop || first.offsetTop > box.scrollTop + box.clientHeight - 20)
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
  box.textContent = "";
  state.cells = header.input_tokens.map((tok, i) => {
    const s = document.createElement("span");
    s.textContent = tok;
    s.className = i >= start && i < end ? "source" : "outside";
    box.appendChild(s);
    return s;
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
  if (context.trim()) attribution.source = context;
  return { model: MODEL, messages: [{ role: "user", content }], stream: true,
           max_tokens: Number($("max_tokens").value), attribution };
}

async function ask(event) {
  event.preventDefault();
  Object.assign(state, { header: null, steps: [], cells: [], pinned: null });
  $("answer").textContent = ""; $("prompt").textContent = "";
  $("status").textContent = "streaming"; $("send").disabled = true;
  try {
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
