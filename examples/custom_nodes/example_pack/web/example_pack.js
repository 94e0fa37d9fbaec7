// Editor extension of Weft's example pack, served at /extensions/example_pack/example_pack.js.
// The editor imports every .js file that /extensions lists; from this URL, ../../scripts/app.js is
// the editor's own app module.
import { app } from "../../scripts/app.js";

app.registerExtension({
    name: "weft.example_pack",
    async beforeRegisterNodeDef(nodeType, nodeData) {
        if (nodeData.name !== "ExampleJoinText") {
            return;
        }
        // Show the joined text (the node's "text" UI output) in a read-only widget after each run.
        const onExecuted = nodeType.prototype.onExecuted;
        nodeType.prototype.onExecuted = function (message) {
            onExecuted?.apply(this, arguments);
            const text = (message?.text ?? []).join("\n");
            let widget = this.widgets?.find((w) => w.name === "joined");
            if (!widget) {
                widget = this.addWidget("text", "joined", "", () => {}, { serialize: false });
                widget.disabled = true;
            }
            widget.value = text;
            this.setDirtyCanvas(true, true);
        };
    },
    nodeCreated(node) {
        // Tint the example nodes so they are easy to spot on the canvas.
        if (node.comfyClass?.startsWith("Example")) {
            node.color = "#2a4d3a";
            node.bgcolor = "#1f3a2b";
        }
    },
});
