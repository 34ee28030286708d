"""Imported once by the harness's forkserver: everything a trainer run imports lazily (model classes,
DCP, the report's matplotlib ...), so every forked run starts warm. Speed only; nothing depends on it."""

import importlib

for _name in ("torch", "torch.distributed.checkpoint", "transformers", "transformers.models.qwen2.modeling_qwen2",
              "transformers.modeling_utils", "accelerate", "tokenizers", "pyarrow.parquet", "datasets", "hydra",
              "matplotlib.pyplot", "torchdata.stateful_dataloader", "rlfoundry.trainer.main_ppo",
              "rlfoundry.trainer.ppo.ray_trainer", "rlfoundry.workers.fsdp_workers", "rlfoundry.workers.critic",
              "rlfoundry.workers.rollout.hf_rollout", "rlfoundry.data", "rlfoundry.rewards",
              "rlfoundry.trainer.report", "rlfoundry.utils.tracking"):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - an optional package missing only costs speed
        pass
