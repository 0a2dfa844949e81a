"""streamrl.trainer."""

# host:port of trainer process 0's coordination service (trainer.num_processes > 1): what
# `streamrl up` (or compose, per service) sets for every trainer process
COORDINATOR_ENV = "STREAMRL_COORDINATOR"
