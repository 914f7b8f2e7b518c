// The colour of a MACS heat weight in [0, 1] (viz._unit: white at the shown tokens' lowest log consistency,
// red at their highest). Explanation.to_html() inlines this file and the server's live page loads it, so
// both colour alike.
function macsHeatColour(weight) {
  const fade = Math.round(255 * (1 - weight));
  return `rgb(255,${fade},${fade})`;
}
