"""The engine's core: requests, the scheduler and its policies, the block manager, the prefix cache and the step-cost
model. It decides what each step computes and imports nothing of the executor."""
