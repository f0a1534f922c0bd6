"""Launch trainer runs through submitit, locally or on Slurm, and follow them from notebooks.

    from workbench.launch import LaunchSpec, submit
    job = submit(LaunchSpec.build(preset="tiny", recipe="mxfp4", steps=20, ep=4, nodes=1,
                                  executor="slurm", folder="runs/ep4"))
    job.wait(); job.state; job.metrics()

A spec is the job's `TrainConfig` (`spec.train`) plus its `Resources` (`spec.resources`);
`LaunchSpec.build` routes each keyword to the one that declares it.

`submitit` (extra `launch`) is imported only when a job is submitted or inspected.
"""

from .handle import TERMINAL, JobFailedError, JobHandle, LaunchError
from .spec import LaunchSpec, LaunchSpecError, Resources, ep4, ep4x2_fsdp, ep8, local
from .submit import make_executor, submit, sweep, sweep_specs
from .watch import curves, status, watch

attach = JobHandle.attach

__all__ = [
           "TERMINAL",
           "JobFailedError",
           "JobHandle",
           "LaunchError",
           "LaunchSpec",
           "LaunchSpecError",
           "Resources",
           "attach",
           "curves",
           "ep4",
           "ep4x2_fsdp",
           "ep8",
           "local",
           "make_executor",
           "status",
           "submit",
           "sweep",
           "sweep_specs",
           "watch",
]
