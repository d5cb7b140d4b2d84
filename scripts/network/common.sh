# Helpers for the network profiles (ib.sh, roce.sh, hccl.sh), sourced by them.
#
# slmoe_net_default VAR VALUE: the profile's value for VAR unless the environment already has
# one. Every profile value is such a default: export VAR=... before launching to override it, or
# export VAR= (empty) to leave VAR unset, i.e. to the library's own default.
slmoe_net_default() {
    local name=$1 value=$2
    if [ -z "${!name+set}" ]; then
        export "$name=$value"
    elif [ -z "${!name}" ]; then
        unset "$name"
    else
        export "${name?}"
    fi
}
