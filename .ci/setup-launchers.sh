#!/usr/bin/env bash
# Install what tests/launcher's multi-node tests need: OpenSSH (client + server), pdsh, Open MPI, numactl.
# Idempotent; run as root on Debian/Ubuntu before pytest. A package that cannot be installed is reported
# and skipped (the tests that need it then skip and say why) instead of failing the whole CI job.
set -u

PACKAGES=(openssh-client openssh-server pdsh openmpi-bin numactl procps)

if [ "$(id -u)" != "0" ]; then
    echo "setup-launchers: not root; skipping package installation (multi-node tests may skip)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-launchers: no apt-get on this machine; skipping (multi-node tests may skip)"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "setup-launchers: all of ${PACKAGES[*]} already installed"
else
    apt-get update || echo "setup-launchers: apt-get update failed; trying to install anyway"
    # One package at a time, so that one unavailable package does not block the others.
    for pkg in "${missing[@]}"; do
        if apt-get install -y --no-install-recommends "$pkg"; then
            echo "setup-launchers: installed $pkg"
        else
            echo "setup-launchers: could not install $pkg; the tests that need it will skip"
        fi
    done
fi

# sshd refuses to start without its privilege-separation directory (normally made by the service unit).
mkdir -p /run/sshd && chmod 0755 /run/sshd

for tool in sshd ssh ssh-keygen pdsh mpirun ompi_info numactl; do
    if command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ]; then
        echo "setup-launchers: $tool OK"
    else
        echo "setup-launchers: $tool MISSING"
    fi
done
exit 0
