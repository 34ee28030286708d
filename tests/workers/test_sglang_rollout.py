"""The SGLang rollout engine's own parts: how verl's keys map onto SGLang's engine arguments, and the
install message where SGLang is missing. What every engine must do (layout, agreement with the HF
engine and the actor, weight syncs, GRPO end to end, tool conversations, a judge) is
``test_rollout_contract.py``, whose ``sglang`` parameter runs in SGLang's environment
(``bash scripts/setup_sglang_cpu.sh && bash scripts/test_sglang.sh``).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


# --------------------------------------------------------------------------- main environment

def test_module_imports_without_sglang_and_maps_verl_keys():
    from omegaconf import OmegaConf

    from rlfoundry.workers.rollout import sglang_rollout as sr

    assert HAVE_SGLANG or "sglang" not in sys.modules
    cfg = OmegaConf.create({"dtype": "bf16", "load_format": "dummy_dtensor", "prompt_length": 16,
                            "response_length": 8, "max_num_seqs": 4, "free_cache_engine": True, "seed": 3,
                            "tensor_model_parallel_size": 2, "gpu_memory_utilization": 0.4,
                            "engine_kwargs": {"sglang": {"max_running_requests": 2}}})
    cpu = sr.build_engine_kwargs(cfg, "/m", "cpu", rank=1)
    assert (cpu["dtype"], cpu["load_format"], cpu["context_length"], cpu["random_seed"]) == ("bfloat16", "dummy", 24, 4)
    assert cpu["max_running_requests"] == 2  # engine_kwargs.sglang wins
    assert (cpu["device"], cpu["attention_backend"], cpu["tp_size"], cpu["sleep_on_idle"]) == ("cpu", "torch_native", 1,
                                                                                               True)
    assert cpu["max_total_tokens"] == 4096 and "enable_memory_saver" not in cpu and cpu["skip_tokenizer_init"]
    gpu = sr.build_engine_kwargs(cfg, "/m", "cuda")
    # tensor_model_parallel_size=2 runs as one engine per rank (the config layer warns: test_config.py)
    assert (gpu["tp_size"], gpu["mem_fraction_static"], gpu["enable_memory_saver"]) == (1, 0.4, True)
    assert gpu["enable_weights_cpu_backup"]  # a step without an update generates with the last weights
    assert "device" not in gpu and "max_total_tokens" not in gpu
    # verify mode's digests run in the scheduler as a custom loader, kept beside the user's own
    assert cpu["custom_weight_loader"] == [sr._REPORT_WEIGHTS]
    cfg.engine_kwargs.sglang.custom_weight_loader = ["my_pkg.load"]
    assert sr.build_engine_kwargs(cfg, "/m", "cpu")["custom_weight_loader"] == ["my_pkg.load", sr._REPORT_WEIGHTS]


@pytest.mark.skipif(HAVE_SGLANG, reason="SGLang is installed here")
def test_engine_without_sglang_names_the_install_commands(tiny_model_dir):
    from omegaconf import OmegaConf

    from rlfoundry.workers.rollout.sglang_rollout import SGLangRollout

    with pytest.raises(ImportError, match=r"pip install sglang.*setup_sglang_cpu\.sh"):
        SGLangRollout(None, OmegaConf.create({}), 0, 2, model_path=str(tiny_model_dir))


def test_image_rows_become_sglang_processor_output_requests(tiny_vlm_dir):
    """Without SGLang: a vision model's rows as SGLang requests (one processor-output item per image row, None
    for a text row; image tokens without pixel inputs refused), the weight names SGLang's Qwen2-VL loads, and
    the tiny VLM's processor resolvable by AutoProcessor, as SGLang builds it."""
    import torch
    from transformers import AutoConfig, AutoProcessor

    from rlfoundry.models.vision import ImageTextProcessor
    from rlfoundry.workers.rollout.sglang_rollout import _VisionRequests

    config = AutoConfig.from_pretrained(tiny_vlm_dir)
    vision = _VisionRequests.of(None, str(tiny_vlm_dir), False)
    assert isinstance(AutoProcessor.from_pretrained(tiny_vlm_dir), ImageTextProcessor)
    assert set(vision.logit_bias) == {str(config.image_token_id), str(config.video_token_id)}
    image = config.image_token_id
    pixels = {"pixel_values": torch.ones(16, 384), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    data = vision.image_data([[5, image, image, 6], [7, 8]], [pixels, {}])
    assert data[1] is None and data[0][0]["format"] == "processor_output"
    assert data[0][0]["pixel_values"] is pixels["pixel_values"] and data[0][0]["image_grid_thw"] is pixels["image_grid_thw"]
    with pytest.raises(ValueError, match="image tokens but no multi_modal_inputs"):
        vision.image_data([[5, image, 6]], None)
    with pytest.raises(ValueError, match="no image tokens but multi_modal_inputs"):
        vision.image_data([[5, 6]], [pixels])
    assert _VisionRequests.checkpoint_name("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert _VisionRequests.checkpoint_name("model.language_model.layers.1.mlp.up_proj.weight") == \
        "model.layers.1.mlp.up_proj.weight"
    assert _VisionRequests.checkpoint_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.sglang
@pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed here; run scripts/setup_sglang_cpu.sh then "
                                            "scripts/test_sglang.sh")
def test_sglang_returns_the_experts_a_full_forward_of_the_trainer_chooses(tiny_moe_dir, tokenizer):
    """MoE routing replay with rollout.name=sglang (R3) on the tiny Qwen3-MoE in fp32: SGLang's routed experts,
    laid out as the HF engine's ``routed_experts``, are set at exactly the fed tokens (real prompt tokens, each
    response token but its last) and are the experts a full forward of the trainer's model picks there."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlfoundry.models import routing_replay as rr
    from rlfoundry.workers.rollout.sglang_rollout import SGLangRollout
    from tests.workers import make_prompts, worker_config
    from tests.workers.test_rollout_routing import EOS_THIRD, TEXTS, _teacher_forced_routing

    cfg = worker_config(tiny_moe_dir, ["rollout.name=sglang", "rollout.dtype=float32", "rollout.response_length=10",
                                       "rollout.enable_rollout_routing_replay=true", "rollout.max_num_seqs=16",
                                       "rollout.load_format=auto"])
    engine = SGLangRollout(None, cfg["rollout"], tokenizer.pad_token_id, tokenizer.eos_token_id,
                           model_path=str(tiny_moe_dir))
    try:
        prompts = make_prompts(tokenizer, TEXTS)
        prompts.meta_info.update(n=2, eos_token_id=EOS_THIRD)
        batch = engine.generate_sequences(prompts).batch
    finally:
        engine.shutdown()
    routed, (rows, seq) = batch["routed_experts"], batch["input_ids"].shape
    assert routed.shape == (rows, seq, 2, 2) and routed.dtype == torch.int16
    lengths = batch["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 2  # samples ended at different steps
    fed = batch["attention_mask"].bool().clone()
    fed[torch.arange(rows), seq - batch["responses"].shape[1] + lengths - 1] = False
    assert bool((routed[fed] >= 0).all()) and bool((routed[~fed] == rr.NO_EXPERT).all())
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    own = _teacher_forced_routing(model, batch)
    same = (routed.long().sort(-1).values == own.sort(-1).values).all(-1).all(-1)[fed]
    assert float(same.float().mean()) == 1.0
