// The overview: figures of the whole server, asked for every POLL_MS, and a chart of appends
// per second over the last minutes (uPlot, loaded by the page as a classic script).

import { fetchJson, pageConfig } from "./live.js";

const POLL_MS = 2000;
const config = pageConfig();
const chartElement = document.getElementById("appends-chart");
const problem = document.getElementById("refresh-problem");
const numbers = new Intl.NumberFormat("en");
let chart = null;

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
}

function show(name, text) {
  const node = document.querySelector(`[data-figure="${name}"]`);
  if (node) node.textContent = text;
}

function render(figures) {
  show("streams", numbers.format(figures.streams));
  show("messages", numbers.format(figures.messages));
  show("bytes", bytes(figures.bytes));
  const off = "metrics off";
  show(
    "appends_per_second",
    figures.appends_per_second === null ? (figures.metrics ? "…" : off) : figures.appends_per_second.toFixed(1),
  );
  show("live_readers", figures.live_readers === null ? off : numbers.format(figures.live_readers));
  drawChart(figures.history);
}

function drawChart(history) {
  if (!chartElement || typeof window.uPlot !== "function") return;
  const data = [history.map((point) => point[0]), history.map((point) => point[1])];
  const width = Math.max(300, chartElement.clientWidth);
  if (!chart) {
    chart = new window.uPlot(
      {
        width,
        height: 200,
        legend: { show: false },
        scales: { y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
        axes: [{}, { label: "appends/s", size: 60 }],
        series: [{}, { label: "appends/s", stroke: "#2f6fb0", fill: "rgba(47,111,176,0.15)", width: 2 }],
      },
      data,
      chartElement,
    );
    window.addEventListener("resize", () => chart.setSize({ width: Math.max(300, chartElement.clientWidth), height: 200 }));
  } else {
    chart.setData(data);
  }
  chartElement.dataset.points = String(history.length);
}

async function poll() {
  try {
    render(await fetchJson(config.dataUrl));
    if (problem) problem.hidden = true;
  } catch (error) {
    if (problem) {
      problem.textContent = `Could not refresh: ${error.message}`;
      problem.hidden = false;
    }
  }
}

render(config.figures);
setInterval(poll, POLL_MS);
