# Sourced from ~/.bashrc on every host of deploy/onprem.yaml and deploy/cluster.yaml (their
# setup commands add the line).
# Ray's launcher runs every command, `ray down`'s included, in a login shell that reads
# ~/.bashrc, so this is where the hosts learn two things:

# 1. splitserve's environment (its `ray` and `splitserve`) comes first on PATH.
export PATH="$HOME/splitserve-env/bin:$PATH"

# 2. `ray down` runs `ray stop` on the head and nothing else (with Ray's local provider, Ray on
#    the worker hosts runs on). Stopping Ray under a running splitserve would kill its workers
#    mid-request and leave their KV pools in shared memory. So on the head (where `ray up` put
#    ~/ray_bootstrap_config.yaml) `ray stop` stops splitserve first, the way Ctrl-C does (the
#    pools drain, every worker frees its KV pool, the embedded Redis stops), then Ray on every
#    worker host (over SSH with the launcher's key), then the head's own Ray.
ray() {
    if [ "$1" = stop ] && [ -f ~/ray_bootstrap_config.yaml ]; then
        splitserve stop --ray-worker-hosts
    fi
    command ray "$@"
}
