"""The tools side: the registry of worker tools, the sandboxes they run in, the rq job a tool
worker runs for each call (`jobs`) and the rollout side's async client (`client`)."""

# The one rq job a tool worker runs (`rqguard` refuses every other): named here, where the
# rollout's client can read it without importing the job's module (sandboxes, docker).
JOB_PATH = "streamrl.tools.jobs.run_tool_call"
