//! Hydra's shell completion (`-sc install=bash|zsh|fish`, `uninstall=…`, `query=…`): the shell scripts and
//! the candidates for the word being typed (config groups, their options, config keys and values).
//!
//! The candidates follow Hydra 1.3's `CompletionPlugin._query`: groups and options of the search path
//! (`+`/`~` prefixes kept), keys of the composed config (`key.` for containers, `key=` for values), the
//! current value after `key=`, and file names after `key=./`, `key=/`. Where Hydra fails (a composition
//! error, a key under a value) there are no candidates instead of a traceback.

use crate::compose::{self, ComposeRequest, RunMode};
use crate::interpolate::{self, ResolveContext};
use crate::node::{Node, Value};
use crate::scalar::Scalar;
use crate::search_path::{ObjectType, Repository};

/// The shells Hydra's completion plugins provide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
}

impl Shell {
    pub fn parse(name: &str) -> Option<Shell> {
        match name {
            "bash" => Some(Shell::Bash),
            "zsh" => Some(Shell::Zsh),
            "fish" => Some(Shell::Fish),
            _ => None,
        }
    }
}

/// What `-sc` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Install,
    Uninstall,
    Query,
}

impl Action {
    pub fn parse(name: &str) -> Option<Action> {
        match name {
            "install" => Some(Action::Install),
            "uninstall" => Some(Action::Uninstall),
            "query" => Some(Action::Query),
            _ => None,
        }
    }
}

/// The script `-sc install=<shell>` prints for `exe` (the program's file name), as Hydra's plugins print it;
/// zsh uses the bash script, as in Hydra.
pub fn install_script(shell: Shell, exe: &str) -> String {
    match shell {
        Shell::Bash | Shell::Zsh => format!(
            "export _HYDRA_OLD_COMP=$(complete -p {exe} 2> /dev/null)\n{BASH_FUNCTION}{exe}\n"
        ),
        Shell::Fish => {
            format!("{FISH_FUNCTION}\ncomplete -c {exe} -x -a '(hydra_fish_completion)'\n\n")
        }
    }
}

/// The script `-sc uninstall=<shell>` prints; `old_rule` is `$_HYDRA_OLD_COMP` (bash, zsh).
pub fn uninstall_script(shell: Shell, exe: &str, old_rule: &str) -> String {
    match shell {
        Shell::Bash | Shell::Zsh => {
            format!("unset hydra_bash_completion\n{old_rule}\nunset _HYDRA_OLD_COMP\n")
        }
        Shell::Fish => format!("complete -e -c {exe}\nfunction hydra_fish_completion\nend\n"),
    }
}

/// How the candidates of `-sc query=<shell>` are printed: one line, space-separated (bash, zsh) or one per
/// line (fish).
pub fn format_candidates(shell: Shell, candidates: &[String]) -> String {
    match shell {
        Shell::Bash | Shell::Zsh => candidates.join(" "),
        Shell::Fish => candidates.join("\n"),
    }
}

const BASH_FUNCTION: &str = r#"hydra_bash_completion()
{
    words=($COMP_LINE)
    if [ "${words[0]}" == "python" ]; then
        if (( ${#words[@]} < 2 )); then
            return
        fi
        file_path=$(pwd)/${words[1]}
        if [ ! -f "$file_path" ]; then
            return
        fi
        grep "@hydra.main" $file_path -q
        helper="${words[0]} ${words[1]}"
    else
        helper="${words[0]}"
        true
    fi

    EXECUTABLE=($(command -v $helper))
    if [ "$HYDRA_COMP_DEBUG" == "1" ]; then
        printf "EXECUTABLE_FIRST='${EXECUTABLE[0]}'\n"
    fi
    if ! [ -x "${EXECUTABLE[0]}" ]; then
        false
    fi

    if [ $? == 0 ]; then
        choices=$( COMP_POINT=$COMP_POINT COMP_LINE=$COMP_LINE $helper -sc query=bash)
        word=${words[$COMP_CWORD]}

        if [ "$HYDRA_COMP_DEBUG" == "1" ]; then
            printf "\n"
            printf "COMP_LINE='$COMP_LINE'\n"
            printf "COMP_POINT='$COMP_POINT'\n"
            printf "Word='$word'\n"
            printf "Output suggestions:\n"
            printf "\t%s\n" ${choices[@]}
        fi
        COMPREPLY=($( compgen -o nospace -o default -W "$choices" -- "$word" ));
    fi
}

COMP_WORDBREAKS=${COMP_WORDBREAKS//=}
COMP_WORDBREAKS=$COMP_WORDBREAKS complete -o nospace -o default -F hydra_bash_completion "#;

const FISH_FUNCTION: &str = r#"function hydra_fish_completion
    # Hydra will access COMP_LINE to generate completion candidates
    set -lx COMP_LINE (commandline -cp)

    # Find out how to call the underlying script
    set -l parts (commandline -cpo)
    if test "$parts[1]" = "python" -o "$parts[1]" = "python3"
        set cmd "$parts[1] $parts[2]"
        if not grep -q "@hydra.main" $parts[2]
            return
        end
    else
        set cmd "$parts[1]"
    end

    # Generate candidates
    eval "$cmd -sc query=fish"
end
        "#;

/// The line the shell passed (`COMP_LINE`) without the program name (Hydra's `strip_python_or_app_name`).
pub fn strip_program(line: &str) -> &str {
    let line = line.trim_start();
    let end = line
        .find(|c: char| !(c.is_alphanumeric() || "_-=./".contains(c)))
        .unwrap_or(line.len());
    line[end..].trim_start()
}

/// A completion request: the overrides already typed and the word being typed (`""` after a space).
#[derive(Debug, Clone)]
pub struct Query<'a> {
    pub config_name: &'a str,
    pub job_name: &'a str,
    pub overrides: &'a [String],
    pub word: &'a str,
    pub multirun: bool,
}

/// The sorted, unique candidates for `q.word`.
pub fn candidates(repo: &mut Repository, q: &Query<'_>) -> Vec<String> {
    if let Some((key_eq, file)) = file_word(q.word) {
        let mut out: Vec<String> = complete_files(file)
            .into_iter()
            .map(|f| format!("{key_eq}{f}"))
            .collect();
        out.sort();
        return out;
    }
    // Compose first: a primary config's `hydra.searchpath` adds sources the group queries then see.
    let composed = compose::compose(
        repo,
        &ComposeRequest {
            config_name: q.config_name,
            overrides: q.overrides,
            mode: if q.multirun {
                RunMode::Multirun
            } else {
                RunMode::Run
            },
            job_name: q.job_name,
        },
    )
    .ok();
    let (mut out, exact) = group_matches(repo, q.word);
    if !exact && let Some(composed) = &composed {
        out.extend(key_matches(&composed.config, q.word));
    }
    out.sort();
    out.dedup();
    out
}

/// `key=./path` or `key=/path`: the `key=` part and the path.
fn file_word(word: &str) -> Option<(&str, &str)> {
    let eq = word.rfind('=')?;
    let (key_eq, file) = (&word[..=eq], &word[eq + 1..]);
    let file_like = [".", "/", "\\", "./", ".\\"]
        .iter()
        .any(|p| file.to_lowercase().starts_with(p));
    (!file.is_empty() && file_like).then_some((key_eq, file))
}

fn complete_files(word: &str) -> Vec<String> {
    let path = std::path::Path::new(word);
    let (dir, prefix) = if path.is_dir() {
        (word.to_owned(), String::new())
    } else {
        let dir = word.rfind('/').map_or("", |i| &word[..i]);
        let base = word.rfind('/').map_or(word, |i| &word[i + 1..]);
        (dir.to_owned(), base.to_owned())
    };
    let listing = if dir.is_empty() { "." } else { dir.as_str() };
    let Ok(entries) = std::fs::read_dir(listing) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| name.starts_with(&prefix))
        .map(|name| {
            if dir.is_empty() {
                name
            } else if dir.ends_with('/') {
                format!("{dir}{name}")
            } else {
                format!("{dir}/{name}")
            }
        })
        .collect()
}

/// Config groups (`group=`, `group/`) and options (`group=option`) for `word`, and whether `word` named a
/// group exactly (`group=…`: then config keys are not offered).
fn group_matches(repo: &Repository, word: &str) -> (Vec<String>, bool) {
    let (prefix, word) = match word.chars().next() {
        Some(c @ ('+' | '~')) => (c.to_string(), &word[1..]),
        _ => (String::new(), word),
    };
    let deletion = prefix == "~";
    let mut out = Vec::new();
    let mut exact = false;
    if let Some(eq) = word.rfind('=') {
        let parent = &word[..eq];
        for option in repo.group_options(parent, ObjectType::Config) {
            let name = if parent.is_empty() {
                option
            } else {
                format!("{parent}={option}")
            };
            if name.starts_with(word) {
                out.push(name);
            }
            exact = true;
        }
    } else {
        let parent = word.rfind('/').map_or("", |i| &word[..i]);
        for group in repo.group_options(parent, ObjectType::Group) {
            let name = if parent.is_empty() {
                group
            } else {
                format!("{parent}/{group}")
            };
            if !name.starts_with(word) {
                continue;
            }
            let files = !repo.group_options(&name, ObjectType::Config).is_empty();
            let dirs = !repo.group_options(&name, ObjectType::Group).is_empty();
            out.push(match (dirs, files) {
                (false, true) if !deletion => format!("{name}="),
                (true, false) => format!("{name}/"),
                _ => name,
            });
        }
    }
    (
        out.into_iter().map(|m| format!("{prefix}{m}")).collect(),
        exact,
    )
}

/// Hydra's `_get_matches` on the composed config: keys starting with `word` (`key.` for containers, `key=`
/// for values), or the current value after `key=`.
fn key_matches(root: &Node, word: &str) -> Vec<String> {
    if let Some(exact) = word.strip_suffix(['.', '=']) {
        let Some(found) = select(root, exact) else {
            return Vec::new();
        };
        let values = if found.value.is_container() {
            children(&found, "")
        } else {
            match &found.value {
                Value::Scalar(Scalar::None) => Vec::new(),
                Value::Missing => vec![String::new()],
                Value::Scalar(Scalar::Bool(b)) => vec![b.to_string()],
                other => vec![other.python_str()],
            }
        };
        return values.into_iter().map(|v| format!("{word}{v}")).collect();
    }
    match word.rfind('.') {
        Some(dot) => {
            let (base, partial) = (&word[..dot], &word[dot + 1..]);
            select(root, base)
                .map(|found| children(&found, partial))
                .unwrap_or_default()
                .into_iter()
                .map(|m| format!("{base}.{m}"))
                .collect()
        }
        None => children(root, word),
    }
}

/// Keys (dict) or indices (list) of `node` that start with `partial`: `key.` for containers, `key=` else.
fn children(node: &Node, partial: &str) -> Vec<String> {
    let rep = |key: String, value: &Node| {
        if value.value.is_container() {
            format!("{key}.")
        } else {
            format!("{key}=")
        }
    };
    match &node.value {
        Value::Dict(d) => d
            .iter()
            .map(|(k, v)| (k.to_string(), v))
            .filter(|(k, _)| k.starts_with(partial))
            .map(|(k, v)| rep(k, v))
            .collect(),
        Value::List(items) => items
            .iter()
            .enumerate()
            .filter(|(i, _)| i.to_string().starts_with(partial))
            .map(|(i, v)| rep(i.to_string(), v))
            .collect(),
        _ => Vec::new(),
    }
}

/// `OmegaConf.select(root, path)`: the node at `path`, interpolations resolved where they resolve (the raw
/// node where they do not); `None` where there is no such key.
fn select(root: &Node, path: &str) -> Option<Node> {
    let raw = root.get_path(path)?;
    let ctx = match root.get("hydra") {
        Some(hydra) => ResolveContext::new().with_hydra(hydra),
        None => ResolveContext::new(),
    };
    Some(interpolate::resolve_at(root, path, &ctx).unwrap_or_else(|_| raw.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_program_name_is_stripped() {
        assert_eq!(
            strip_program("rlsync train_embodied a."),
            "train_embodied a."
        );
        assert_eq!(strip_program("  ./target/release/rlsync "), "");
        assert_eq!(strip_program("rlsync"), "");
    }

    #[test]
    fn file_words_need_a_path_after_the_equals_sign() {
        assert_eq!(file_word("a.b=./x"), Some(("a.b=", "./x")));
        assert_eq!(file_word("a.b=/"), Some(("a.b=", "/")));
        assert_eq!(file_word("a.b="), None);
        assert_eq!(file_word("a.b=1"), None);
        assert_eq!(file_word("./x"), None);
    }
}
