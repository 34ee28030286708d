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
    assert (gpu["tp_size"], gpu["mem_fraction_static"], gpu["enable_memory_saver"]) == (2, 0.4, True)
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
