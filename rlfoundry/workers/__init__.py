"""Workers that hold models: actor/rollout/reference (hybrid), critic, reward model.

Import the submodule you need (``rlfoundry.workers.actor_rollout_ref``, ``rlfoundry.workers.critic`` …);
this package imports nothing heavy so that importing one worker stays cheap.
"""
