"""What the tests share: random paged batches, the recorded digests and golden data, the device
planner's host reference, the Llama example as a module."""
