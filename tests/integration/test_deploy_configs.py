"""deploy/*.yaml are valid for the installed Ray (Ray's own validation, not a hand-written
schema), and the splitserve commands they run are ones our CLI takes, asking for the
custom resources their node types offer."""
from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_the_cloud_template_is_valid_for_ray() -> None:
    validate_config(prepare_config(load("cluster.yaml")))  # the AWS provider's defaults filled in, as `ray up` does


def test_the_local_template_is_valid_for_ray_and_a_broken_one_is_not() -> None:
    config = load("local.yaml")  # complete as written (this Ray wheel ships no fake_multinode defaults)
    validate_config(config)
    broken = copy.deepcopy(config)
    broken["available_node_types"]["decode"]["min_workers"] = "two"
    with pytest.raises(Exception, match="is not of type 'integer'"):
        validate_config(broken)


def splitserve_commands(config: dict) -> list[list[str]]:
    out = []
    for line in config.get("head_start_ray_commands", []):
        words = shlex.split(line)
        for i, w in enumerate(words):
            if w.endswith("/splitserve") or w == "splitserve":
                out.append([a for a in words[i + 1:] if a not in (">", "2>&1", "&") and not a.startswith("~/")])
    return out


def test_the_head_starts_splitserve_with_flags_that_exist_and_resources_the_nodes_offer() -> None:
    config = load("cluster.yaml")
    [argv] = splitserve_commands(config)
    args = build_parser().parse_args(argv)  # an unknown flag would exit here
    assert args.ray_address == "auto" and args.host == "0.0.0.0"
    types = config["available_node_types"]
    assert args.prefill_resource in types["prefill"]["resources"]
    assert args.decode_resource in types["decode"]["resources"]
    assert args.prefill_resource not in types["head"]["resources"]
    for role in ("prefill", "decode"):  # one worker per GPU at degree 1; a split worker takes its degree's GPUs
        assert types[role]["resources"][role] == types[role]["resources"]["GPU"]
        assert types[role]["resources"]["GPU"] % getattr(args, f"{role}_tp") == 0


def test_the_onprem_file_is_valid_for_ray_and_its_hosts_offer_what_serve_asks_for() -> None:
    config = load("onprem.yaml")
    prepared = prepare_config(config)  # the local provider's single node type filled in, as `ray up` does
    validate_config(prepared)
    assert prepared["available_node_types"]["local.cluster.node"]["min_workers"] == len(config["provider"]["worker_ips"])
    [argv] = splitserve_commands(config)
    args = build_parser().parse_args(argv)
    assert args.detach and args.ray_address == "auto" and args.host == "0.0.0.0" and args.redis_host == "0.0.0.0"
    roles = config["worker_start_ray_commands"][1]
    for ip, role in zip(config["provider"]["worker_ips"], (args.prefill_resource, args.decode_resource)):
        assert f'*" {ip} "*) ROLE=\'{{"{role}": ' in roles  # each worker host offers one role's resource
    assert config["provider"]["head_ip"] not in roles  # the head offers neither
    assert (DEPLOY / "onprem-profile.sh").is_file() and "onprem-profile.sh" in " ".join(config["setup_commands"])
