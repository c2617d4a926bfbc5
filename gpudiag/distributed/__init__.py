"""The ddp stage's processes: the launcher (torch.distributed.run) and one rank's program."""
