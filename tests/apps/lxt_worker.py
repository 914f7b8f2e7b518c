"""AttnLRP relevances from lxt 2.1 itself, for tests/apps/test_attnlrp.py; run by the python of a separate venv.

lxt 2.1 needs transformers 4.x (it does not import under 5.x), so it cannot run in the package's own
environment. Set-up (NOTES section 9): python -m venv /opt/lxt-venv; pip install torch==2.13.0;
pip install lxt==2.1 torch==2.13.0; pip uninstall -y torchvision open_clip_torch timm;
pip install transformers==4.57.6.

    python lxt_worker.py REQUEST.json RESULT.json

REQUEST: {"model": folder saved by save_pretrained, "input_ids": [...], "generated_ids": [...],
"variant": "attnlrp" | "cp-lrp"}. RESULT: {"relevance": steps rows over each step's whole input
(prompt + generated prefix), "target_logits": [...], "versions": {...}}. Each step is its own forward over
prompt + generated[:k] and one backward from the logit of generated[k] (lxt's documented recipe), with
lxt's monkey_patch applied to transformers' Llama module for the whole (short-lived) process.
"""
import json
import sys
import types
from importlib.metadata import version


def _import_lxt_without_torchvision():
    """lxt.efficient imports its ViT map, which imports torchvision; the only torchvision wheel here links
    CUDA and breaks transformers' imports, and text models never touch it: a stand-in module while lxt is
    imported suffices (transformers is imported first and sees no torchvision at all)."""

    class _Anything(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):  # module protocol (__file__, __path__, ...): absent, as for a real module
                raise AttributeError(name)
            return type(name, (), {})

    import torch

    torchvision = types.ModuleType("torchvision")
    models = types.ModuleType("torchvision.models")
    models.vision_transformer = _Anything("torchvision.models.vision_transformer")
    # Its patch map names torch.nn classes through the module (only listed there, never patched here).
    models.vision_transformer.nn = torch.nn
    torchvision.models = models
    stubs = {"torchvision": torchvision, "torchvision.models": models,
             "torchvision.models.vision_transformer": models.vision_transformer}
    sys.modules.update(stubs)
    try:
        from lxt.efficient import monkey_patch
    finally:
        for name in stubs:
            del sys.modules[name]
    return monkey_patch


def main(request_path: str, result_path: str) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    monkey_patch = _import_lxt_without_torchvision()
    from lxt.efficient.models.llama import attnLRP, cp_LRP

    request = json.load(open(request_path))
    monkey_patch(modeling_llama, {"attnlrp": attnLRP, "cp-lrp": cp_LRP}[request["variant"]])
    config = AutoConfig.from_pretrained(request["model"])
    # transformers 4.x ignores 5.x's "rope_parameters" and would silently use rope_theta 10000.
    saved = json.load(open(f"{request['model']}/config.json"))
    if "rope_theta" in saved.get("rope_parameters", {}):
        config.rope_theta = saved["rope_parameters"]["rope_theta"]
    model = AutoModelForCausalLM.from_pretrained(request["model"], config=config, dtype=torch.float32).eval()
    prompt, generated = request["input_ids"], request["generated_ids"]
    rows, logits = [], []
    for k, target in enumerate(generated):
        ids = torch.tensor([prompt + generated[:k]])
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logit = model(inputs_embeds=embeddings, use_cache=False).logits[0, -1, target]
        logit.backward()
        rows.append((embeddings * embeddings.grad).float().sum(-1)[0].tolist())
        logits.append(logit.item())
    json.dump({"relevance": rows, "target_logits": logits,
               "versions": {"lxt": version("lxt"), "transformers": transformers.__version__,
                            "torch": torch.__version__}}, open(result_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
