"""How a run's processes start, live and stop: `streamrl up`'s supervision (`supervise`) and
what it reports (`summary`)."""
