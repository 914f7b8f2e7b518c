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

// An image with its token grid over the part of the image the grid covers (ImageTokens.as_dict(): size, box,
// grid, positions), appended to `container`; returns the grid's cells, one per image token in raster order.
// Both image pages use it: Explanation.to_html()'s and the server's live page.
function macsImageGrid(picture, src, container) {
  const frame = document.createElement("div"), img = document.createElement("img"), grid = document.createElement("div");
  frame.className = "picture"; img.src = src; grid.className = "grid";
  const [w, h] = picture.size, [l, t, r, b] = picture.box;
  Object.assign(grid.style, { left: 100 * l / w + "%", top: 100 * t / h + "%", width: 100 * (r - l) / w + "%",
    height: 100 * (b - t) / h + "%", gridTemplateRows: `repeat(${picture.grid[0]}, 1fr)`,
    gridTemplateColumns: `repeat(${picture.grid[1]}, 1fr)` });
  frame.append(img, grid);
  container.appendChild(frame);
  return picture.positions.map(() => grid.appendChild(document.createElement("div")));
}
