"""ART's checkpoint transport as a backend's methods: ``_experimental_push_to_s3``,
``_experimental_pull_from_s3`` and ``_experimental_deploy``, thin entry points over ``artery.s3``
(ART's bucket layout and ``BACKUP_BUCKET``, any S3-compatible store through boto3, the ``s3``
extra). ``artery.backend.Backend`` inherits them, so they read as ART's ``backend.*`` methods."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from artery import s3

if TYPE_CHECKING:
    from artery.checkpoint_layout import CheckpointBackend
    from artery.model import Model


class S3Transport:
    """Mixed into a backend that has what ``artery.checkpoint_layout.CheckpointBackend`` names;
    each method hands the backend itself to ``artery.s3``."""

    async def _experimental_push_to_s3(
        self: CheckpointBackend,
        model: Model,
        *,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> None:
        """Upload the model directory (history, trajectories) and every step the publisher keeps,
        adapter and trainer state, to ``s3://{bucket}/{prefix/}{project}/models/{name}/``."""
        await s3.push(self, model, s3_bucket=s3_bucket, prefix=prefix, verbose=verbose, delete=delete)

    async def _experimental_pull_from_s3(
        self: CheckpointBackend,
        model: Model,
        step: int | None = None,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
        *,
        only_step: int | Literal["latest"] | None = None,  # a step, "latest" or None (all)
        exclude: list[s3.Excludable] | None = None,
        latest_only: bool = False,
    ) -> None:
        """Download the model directory from S3; the newest step pulled becomes the model's
        current step when it is newer than the one here (served, and trained on from there).
        ``step`` and ``latest_only`` are ART's older spellings of ``only_step``."""
        if step is not None and only_step is not None and step != only_step:
            raise ValueError(f"step={step} and only_step={only_step!r} disagree: give one")
        only_step = only_step if only_step is not None else step
        if latest_only and only_step is None:
            only_step = "latest"
        await s3.pull(
            self,
            model,
            s3_bucket=s3_bucket,
            prefix=prefix,
            verbose=verbose,
            delete=delete,
            only_step=only_step,
            exclude=exclude or (),
        )

    async def _experimental_deploy(
        self: CheckpointBackend,
        deploy_to,
        model: Model,
        step: int | None = None,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        pull_s3: bool = True,
        wait_for_completion: bool = True,
    ):
        """ART's deploy up to the vendor's API: the step's adapter zipped into the bucket with a
        presigned URL; then ``artery.s3.DeploymentUnsupported`` (carrying them), since Artery
        calls no vendor's API. ``wait_for_completion`` has nothing to wait for."""
        await s3.deploy(
            self,
            deploy_to,
            model,
            step=step,
            s3_bucket=s3_bucket,
            prefix=prefix,
            verbose=verbose,
            pull_s3=pull_s3,
        )
