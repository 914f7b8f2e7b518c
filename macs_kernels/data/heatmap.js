// The colour of a MACS heat weight in [0, 1] (viz._unit: white at the shown tokens' lowest log consistency,
// red at their highest). Explanation.to_html() inlines this file and the server's live page loads it, so
// both colour alike.
function macsHeatColour(weight) {
  const fade = Math.round(255 * (1 - weight));
  return `rgb(255,${fade},${fade})`;
}

// The generated tokens as spans in `answer`: hovering one shows its step, clicking pins it (again: unpins).
// paint(k, label) draws step k, or the whole answer for k === null. Both pages of Explanation.to_html() use it.
function macsAnswerTokens(tokens, answer, paint) {
  let pinned = null;
  tokens.forEach((tok, k) => {
    const s = document.createElement("span"); s.textContent = tok; answer.appendChild(s);
    s.addEventListener("mouseenter", () => {
      if (pinned === null) paint(k, `step ${k} (${JSON.stringify(tok)})`);
    });
    s.addEventListener("mouseleave", () => { if (pinned === null) paint(null, "whole answer"); });
    s.addEventListener("click", () => {
      answer.querySelectorAll("span").forEach(x => x.classList.remove("active"));
      if (pinned === k) { pinned = null; paint(null, "whole answer"); return; }
      pinned = k; s.classList.add("active"); paint(k, `step ${k} (${JSON.stringify(tok)}), pinned`);
    });
  });
  paint(null, "whole answer");
}
