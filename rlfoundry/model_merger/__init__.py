"""verl's ``verl.model_merger``: a saved role's checkpoint as a Hugging Face directory, and the check of one.

    python -m rlfoundry.model_merger merge --backend fsdp --local_dir CKPT/global_step_N/actor --target_dir HF_DIR
    python -m rlfoundry.model_merger test --backend fsdp --local_dir CKPT/global_step_N/actor --test_hf_dir REF_DIR

The command line is verl's; the work is ``rlfoundry export``'s (``checkpoint/export.py``: the exporter of the
engine that saved the role). ``merge.py`` says what each flag does here and where it differs.
"""
