// Weft's own editor extension.
// - The editor's built-in default graph needs models and nodes Weft does not have; Weft's default
//   graph is workflows/default.json (served at /templates/default.json), so a fresh editor opens a
//   workflow that runs. The editor reads its default graph from this object when it starts.
// - The About panel names the server, linking to what it reports about itself.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const holder = window.comfyAPI?.defaultGraph;
if (holder?.defaultGraph) {
  try {
    const response = await fetch(api.fileURL("/templates/default.json"), { cache: "no-store" });
    if (response.ok) {
      const graph = await response.json();
      const target = holder.defaultGraph;
      for (const key of Object.keys(target)) delete target[key];
      Object.assign(target, graph);
      holder.defaultGraphJSON = JSON.stringify(graph);
    }
  } catch (error) {
    console.warn("[weft] keeping the editor's own default graph:", error);
  }
}

app.registerExtension({
  name: "weft.about",
  aboutPageBadges: [
    { label: "Weft", url: "api/system_stats", icon: "pi pi-server" },
  ],
});
