"""``lightning-accum dashboard``: the ready-made W&B workspace, written to a JSON file or uploaded to a project."""

from __future__ import annotations

import argparse
from typing import Any

from lightning_accum.cli._common import CommandError, check_output_file
from lightning_accum.integrations.wandb import USER_PREFIXES

HELP = "create the lightning_accum W&B workspace (or write its spec with --output)"

DESCRIPTION = (
    "Build the W&B workspace with the Batch, Tokens, Ranks, Noise scale, Memory, Recovery and Throughput sections"
    " for the metrics AccumulationMonitor logs, and a 'Your metrics' section for your own (train/*, val/*). With"
    " --output, write its JSON spec and touch no network; without it, save it to ENTITY/PROJECT on W&B (needs a"
    " login)."
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``dashboard`` subcommand's arguments to its parser (`lightning_accum.cli.main` builds it); return it."""
    parser.add_argument("--entity", required=True, help="the W&B entity (user or team) that owns the project")
    parser.add_argument("--project", required=True, help="the W&B project")
    parser.add_argument("--name", default="lightning_accum", help="the workspace name (default: %(default)s)")
    parser.add_argument("--output", "-o", help="write the spec as JSON here instead of uploading it")
    parser.add_argument(
        "--user-prefixes",
        nargs="*",
        metavar="PREFIX",
        default=list(USER_PREFIXES),
        help="one 'Your metrics' panel per prefix, drawing every key under it (default: %(default)s; none: no panels)",
    )
    parser.add_argument(
        "--user-keys",
        nargs="+",
        metavar="KEY",
        default=[],
        help="one 'Your metrics' panel per key, for keys outside the prefixes (e.g. train_loss_step)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Write the spec (``--output``) or upload the workspace; return the exit status.

    Raises:
        CommandError: a missing package, an empty entity or project, an output that cannot be written, no W&B login
            (found before any network access), or an upload that W&B refused.
    """
    for flag, value in (("--entity", args.entity), ("--project", args.project)):
        if not value.strip():
            raise CommandError(f"`{flag}` must name a W&B {flag[2:]}, got {value!r}. Pass e.g. `{flag} my-{flag[2:]}`.")
    output = None if args.output is None else check_output_file(args.output, "--output", "workspace.json")
    try:
        import wandb

        from lightning_accum.integrations import wandb as integration

        if output is None:
            _check_login()
            try:
                url = integration.save_dashboard(args.entity, args.project, **_options(args))
            except (wandb.errors.Error, OSError) as err:  # requests' errors are OSErrors
                raise CommandError(
                    f"could not save the workspace to {args.entity}/{args.project} on W&B: {err}. Check the entity and"
                    " project names and your access to them, or pass `--output FILE` to write the spec instead."
                ) from err
            print(f"saved the workspace: {url}")
            return 0
        text = integration.spec_to_json(integration.dashboard_spec(args.entity, args.project, **_options(args)))
    except ModuleNotFoundError as err:
        raise CommandError(
            f"`lightning-accum dashboard` needs {err.name!r}: pip install 'lightning-accum[wandb]'."
        ) from err
    except ValueError as err:
        raise CommandError(str(err)) from err
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
    except OSError as err:
        raise CommandError(f"`--output`={args.output!r} could not be written: {err}. Choose another path.") from err
    print(f"wrote {output}")
    return 0


def _options(args: argparse.Namespace) -> dict[str, Any]:
    # The workspace's name and the user's own metrics, as `dashboard_spec` and `save_dashboard` take them.
    return {"name": args.name, "user_prefixes": tuple(args.user_prefixes), "user_keys": tuple(args.user_keys)}


def _check_login() -> None:
    """Raise `CommandError` when wandb has no credentials for its server; reads the environment and files only.

    Without this, ``wandb.Api()`` (inside the upload) prompts for a key on a terminal, and fails with a traceback
    elsewhere.
    """
    from wandb import env
    from wandb.errors import AuthenticationError

    try:
        # Private in wandb 0.31 (`wandb/sdk/lib/wbauth/authenticate.py`): the lookup `wandb.Api()` starts with
        # (WANDB_API_KEY, an identity token file, netrc, settings), asked not to prompt. `prompt=False` and
        # `verify=False` (the default) keep it off the network.
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        host = env.get_base_url(wandb_setup.singleton().settings.base_url)
        auth = wbauth.authenticate_session(
            host=host, source="lightning-accum dashboard", prompt=False, update_session=False
        )
    except (ImportError, AttributeError, TypeError):
        return  # another wandb: the upload reports a missing login itself
    except AuthenticationError as err:
        raise CommandError(
            f"the W&B credentials found are not usable: {err} Run `wandb login` again or fix WANDB_API_KEY; or pass"
            " `--output FILE` to write the spec, which needs no login."
        ) from err
    if auth is None:
        raise CommandError(
            f"uploading the workspace needs a W&B login, and there is none for {host}: WANDB_API_KEY is unset or"
            " empty and no netrc file has a key for it. Run `wandb login` (or set WANDB_API_KEY), or pass"
            " `--output FILE` to write the spec without uploading."
        )
