# bash completion for sbx. Install: source it from ~/.bashrc, or copy it to
# ~/.local/share/bash-completion/completions/sbx
_sbx() {
    local cur prev words cword
    _init_completion 2>/dev/null || {
        cur=${COMP_WORDS[COMP_CWORD]}; prev=${COMP_WORDS[COMP_CWORD-1]}
        words=("${COMP_WORDS[@]}"); cword=$COMP_CWORD
    }
    local i cmd="" sub=""
    for ((i = 1; i < cword; i++)); do
        case ${words[i]} in
            --) return 0 ;; # the remote command: leave it to the user
            -*) ;;
            *) if [[ -z $cmd ]]; then cmd=${words[i]}; elif [[ $cmd == daemon && -z $sub ]]; then sub=${words[i]}; fi ;;
        esac
    done
    local global="--json --help"
    case $prev in
        --id|--since|--timeout) return 0 ;;
        --init) return 0 ;;
    esac
    case $cmd in
        "") COMPREPLY=($(compgen -W "version daemon config start exec list stop reset init status events $global" -- "$cur")) ;;
        daemon) [[ -z $sub ]] && COMPREPLY=($(compgen -W "status stop" -- "$cur")) || COMPREPLY=($(compgen -W "$global" -- "$cur")) ;;
        start) [[ $cur == -* ]] && COMPREPLY=($(compgen -W "--id --wait --timeout --init $global" -- "$cur")) || _filedir 'y?(a)ml' 2>/dev/null ;;
        reset) [[ $cur == -* ]] && COMPREPLY=($(compgen -W "--wait --timeout --init $global" -- "$cur")) || _filedir 'y?(a)ml' 2>/dev/null ;;
        exec) [[ $cur == -* ]] && COMPREPLY=($(compgen -W "--id --no-sync -i --interactive -- $global" -- "$cur")) || _filedir 'y?(a)ml' 2>/dev/null ;;
        list) COMPREPLY=($(compgen -W "--all $global" -- "$cur")) ;;
        stop) COMPREPLY=($(compgen -W "--id --all $global" -- "$cur")) ;;
        status) [[ $cur == -* ]] && COMPREPLY=($(compgen -W "--id $global" -- "$cur")) || _filedir 'y?(a)ml' 2>/dev/null ;;
        init) [[ $cur == -* ]] && COMPREPLY=($(compgen -W "$global" -- "$cur")) || _filedir 2>/dev/null ;;
        events) COMPREPLY=($(compgen -W "--since $global" -- "$cur")) ;;
        *) COMPREPLY=($(compgen -W "$global" -- "$cur")) ;;
    esac
}
complete -F _sbx sbx
