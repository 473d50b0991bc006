//! Tests of the override grammar: data-driven cases, the conformance kit's values, and fuzzing.

use proptest::prelude::*;
use serde_json::Value as Json;

use super::*;
use crate::kit::{self, decode, regex_literal, same};
use crate::node::{Key, Node};
use crate::scalar::Scalar;

/// A compact rendering that shows types: Python's repr for elements, a tag for sweeps.
fn render(o: &Override) -> String {
    match &o.value {
        None => "<none>".into(),
        Some(OverrideValue::Element(e)) => e.python_repr(),
        Some(OverrideValue::Sweep(Sweep::Choice(c))) => {
            let items: Vec<String> = c.items.iter().map(Element::python_repr).collect();
            let form = if c.simple_form { "simple" } else { "choice" };
            let shuffle = if c.shuffle { " shuffled" } else { "" };
            let tags = if c.tags.is_empty() {
                String::new()
            } else {
                format!(" tags={:?}", c.tags)
            };
            format!("{form}[{}]{shuffle}{tags}", items.join(", "))
        }
        Some(OverrideValue::Sweep(Sweep::Range(r))) => format!(
            "range({}, {}, {}){}",
            r.start.python_str(),
            r.stop.python_str(),
            r.step.python_str(),
            if r.shuffle { " shuffled" } else { "" }
        ),
        Some(OverrideValue::Sweep(Sweep::Interval(i))) => {
            format!("interval({}, {})", i.start.python_str(), i.end.python_str())
        }
        Some(OverrideValue::Sweep(Sweep::Glob(g))) => {
            format!("glob({:?}, {:?})", g.include, g.exclude)
        }
    }
}

fn check(input: &str, expect: &str) {
    match parse_override(input) {
        Ok(o) => assert_eq!(render(&o), expect, "value of {input:?}"),
        Err(e) => panic!("{input:?} failed to parse: {e}"),
    }
}

fn check_err(input: &str, expect: &str) {
    match parse_override(input) {
        Ok(o) => panic!("{input:?} parsed as {}", render(&o)),
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains(expect),
                "error of {input:?} is {text:?}, expected to contain {expect:?}"
            );
            assert!(
                text.ends_with(GRAMMAR_HINT),
                "error of {input:?} lacks the hint: {text:?}"
            );
            let bare = [
                "no viable alternative",
                "mismatched input",
                "LexerNoViableAltException",
            ];
            assert!(
                text.starts_with(&format!("Error parsing override '{input}'\n"))
                    || bare.iter().any(|b| text.starts_with(b)),
                "{text:?}"
            );
        }
    }
}

#[test]
fn primitives_are_typed_as_hydra_types_them() {
    let cases = [
        ("a=abc", "'abc'"),
        ("a=1", "1"),
        ("a=-1", "-1"),
        ("a=10_0", "100"),
        // Python ints are unbounded (checked against Hydra's oracle).
        ("a=99999999999999999999", "99999999999999999999"),
        ("a=-9_223_372_036_854_775_809", "-9223372036854775809"),
        ("a=-0x8000000000000001", "'-0x8000000000000001'"),
        ("a=int(1e20)", "100000000000000000000"),
        (
            "a=int('123456789012345678901234567890')",
            "123456789012345678901234567890",
        ),
        ("a=float(99999999999999999999)", "1e+20"),
        ("a=str(99999999999999999999)", "'99999999999999999999'"),
        ("a=bool(99999999999999999999)", "True"),
        (
            "a=sort([99999999999999999999,1,-99999999999999999999])",
            "[-99999999999999999999, 1, 99999999999999999999]",
        ),
        ("a={99999999999999999999: 1}", "{99999999999999999999: 1}"),
        ("a=1.0", "1.0"),
        ("a=1e-05", "1e-05"),
        ("a=3.1_4", "3.14"),
        ("a=10e0", "10.0"),
        ("a=1.e5", "100000.0"),
        ("a=+inf", "inf"),
        ("a=-INF", "-inf"),
        ("a=NaN", "nan"),
        ("a=true", "True"),
        ("a=FaLsE", "False"),
        ("a=null", "None"),
        ("a=NULL", "None"),
        ("a='1'", "'1'"),
        ("a=123abc", "'123abc'"),
        ("a=1___0___", "'1___0___'"),
        ("a=05.5", "'05.5'"),
        ("a= abc-123 ", "'abc-123'"),
        ("a=a b c\t-\t1 2 3", "'a b c\\t-\\t1 2 3'"),
        ("a=", "''"),
        ("a= ", "''"),
        ("a=.", "'.'"),
        ("a=/-\\+.$%*@?|", "'/-\\\\+.$%*@?|'"),
        ("a=c:\\foo\\a-b.txt", "'c:\\\\foo\\\\a-b.txt'"),
        ("a=a : b", "'a : b'"),
        ("a=${a.b.c}", "'${a.b.c}'"),
        ("a=xyz_${a.b.c}", "'xyz_${a.b.c}'"),
        ("a=${foo:1,2,3}", "'${foo:1,2,3}'"),
        ("a=???", "'???'"),
        ("a='\u{5e9}x'", "'\u{5e9}x'"),
    ];
    for (input, want) in cases {
        check(input, want);
    }
}

#[test]
fn escapes_and_quotes() {
    let cases = [
        (r"a=a\:b", "'a:b'"),
        (r"a=\,", "','"),
        (r"a=f\(a\, b\)", "'f(a, b)'"),
        (r"a=$\{foo.bar\}", "'${foo.bar}'"),
        (r"a=ab\\", r"'ab\\'"),
        (r"a=\\\\\\", r"'\\\\\\'"),
        (
            "a=ab\\\\\\(cd\\{ef\\}\\[gh\\]\\)\\:\\ ij\\,kl\\\t",
            r"'ab\\(cd{ef}[gh]): ij,kl\t'",
        ),
        (r"a='foo \'bar'", "\"foo 'bar\""),
        (r#"a="foo \"bar""#, r#"'foo "bar'"#),
        (r"a='foo\\bar'", r"'foo\\\\bar'"),
        (r"a='foo bar\\'", r"'foo bar\\'"),
        ("a='\t []{},=+~'", r"'\t []{},=+~'"),
        ("a='a,b'", "'a,b'"),
        ("a='${foo:\"\\' }\"}'", r#"'${foo:"\' }"}'"#),
    ];
    for (input, want) in cases {
        check(input, want);
    }
}

#[test]
fn containers() {
    let cases = [
        ("a=[]", "[]"),
        ("a=[1, 2, 3]", "[1, 2, 3]"),
        ("a=[1,'a',[b]]", "[1, 'a', ['b']]"),
        ("a={}", "{}"),
        ("a={a:10,b:{c:[1,2]}}", "{'a': 10, 'b': {'c': [1, 2]}}"),
        ("a={123: 1, 0: 2, -1: 3}", "{123: 1, 0: 2, -1: 3}"),
        ("a={3.14: 0, 1e3: 1}", "{3.14: 0, 1000.0: 1}"),
        ("a={true: 1, fAlSe: 0}", "{True: 1, False: 0}"),
        ("a={null: 1}", "{None: 1}"),
        ("a={ white  space\t: 2}", "{'white  space': 2}"),
        ("a={a:1,a:2}", "{'a': 2}"),
        ("a={1: a, 1.0: b, true: c}", "{1: 'c'}"),
        ("a={a:${b}}", "{'a': '${b}'}"),
        (
            "a={\\\\\\(\\)\\[\\]\\{\\}\\:\\=\\ \\\t\\,: 2}",
            "{'\\\\()[]{}:= \\t,': 2}",
        ),
    ];
    for (input, want) in cases {
        check(input, want);
    }
}

#[test]
fn keys_and_kinds() {
    let cases: [(&str, OverrideKind, &str, Option<&str>); 10] = [
        ("a.b.c=1", OverrideKind::Change, "a.b.c", None),
        ("+x=1", OverrideKind::Add, "x", None),
        ("++x=1", OverrideKind::ForceAdd, "x", None),
        ("~x", OverrideKind::Delete, "x", None),
        (
            "db@backup=mysql",
            OverrideKind::Change,
            "db",
            Some("backup"),
        ),
        (
            "+extra@$foo.bar$.x$z=one",
            OverrideKind::Add,
            "extra",
            Some("$foo.bar$.x$z"),
        ),
        ("+group@=x", OverrideKind::Add, "group", Some("")),
        (
            "hydra/launcher=basic",
            OverrideKind::Change,
            "hydra/launcher",
            None,
        ),
        ("+ab-c/d-ef=1", OverrideKind::Add, "ab-c/d-ef", None),
        ("list.0=1", OverrideKind::Change, "list.0", None),
    ];
    for (input, kind, key, package) in cases {
        let o = parse_override(input).unwrap_or_else(|e| panic!("{input}: {e}"));
        assert_eq!(
            (o.kind, o.key_or_group.as_str(), o.package.as_deref()),
            (kind, key, package),
            "{input}"
        );
        assert_eq!(o.input, input);
    }
    let del = parse_override("~x=").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(del.element(), Some(&Element::str("")));
    assert_eq!(parse_override("~x").map(|o| o.value), Ok(None));
    let o = parse_override("++db@pkg=a").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(o.key_element(), "++db@pkg");
    assert_eq!(o.value_string(), Some("a"));
    assert!(parse_override("hydra.run.dir=x").is_ok_and(|o| o.is_hydra_override()));
}

#[test]
fn functions_evaluate_at_parse_time() {
    let cases = [
        ("a=int(10)", "10"),
        ("a=int(0.0)", "0"),
        ("a=int(1e6)", "1000000"),
        ("a=int('10')", "10"),
        ("a=int(true)", "1"),
        ("a=float(0)", "0.0"),
        ("a=float(inf)", "inf"),
        ("a=float('10')", "10.0"),
        ("a=bool(10)", "True"),
        ("a=bool(0)", "False"),
        ("a=bool(nan)", "True"),
        ("a=str(10.0)", "'10.0'"),
        ("a=str(1e6)", "'1000000.0'"),
        ("a=str(false)", "'false'"),
        ("a=str('')", "''"),
        ("a=str([0,1,2])", "['0', '1', '2']"),
        ("a=float({a:10})", "{'a': 10.0}"),
        ("a=bool({a:[0,1,2]})", "{'a': [False, True, True]}"),
        ("a=bool(null)", "False"),
        ("a=int(value=3)", "3"),
        ("a=sort([2,3,1],reverse=true)", "[3, 2, 1]"),
        ("a=sort(list=[1,2,3], reverse=True)", "[3, 2, 1]"),
        ("a=sort([[1,b],[1,a]])", "[[1, 'a'], [1, 'b']]"),
        ("a=sort(5)", "5"),
        ("a=shuffle(5)", "[5]"),
        ("a=shuffle([])", "[]"),
    ];
    for (input, want) in cases {
        check(input, want);
    }
    let shuffled = parse_override("a=shuffle([1,2,3])").map(|o| o.element().cloned());
    let Ok(Some(Element::List(mut items))) = shuffled else {
        panic!("shuffle of a list is a list: {shuffled:?}")
    };
    items.sort_by_key(|e| match e {
        Element::Scalar(Scalar::Int(i)) => *i,
        _ => i64::MAX,
    });
    assert_eq!(
        items,
        vec![
            Element::Scalar(Scalar::Int(1)),
            Element::Scalar(Scalar::Int(2)),
            Element::Scalar(Scalar::Int(3))
        ]
    );
}

#[test]
fn sweeps() {
    let cases = [
        ("a=1,2", "simple[1, 2]"),
        ("a=a , b", "simple['a', 'b']"),
        ("a=[a,b],[c,d]", "simple[['a', 'b'], ['c', 'd']]"),
        ("a=choice(a,b)", "choice['a', 'b']"),
        ("a=choice (a,b)", "choice['a', 'b']"),
        ("a=choice(\t\t1,   2, \t 3 )", "choice[1, 2, 3]"),
        ("a=choice(1)", "choice[1]"),
        ("a=int(2,1,0)", "simple[2, 1, 0]"),
        ("a=int(choice(0,1))", "choice[0, 1]"),
        ("a=str(choice(0,1))", "choice['0', '1']"),
        ("a=sort(a,c,b,reverse=true)", "simple['c', 'b', 'a']"),
        ("a=sort(choice(3,1,2))", "choice[1, 2, 3]"),
        ("a=shuffle(1,2,3)", "simple[1, 2, 3] shuffled"),
        ("a=shuffle(choice(1,2,3))", "choice[1, 2, 3] shuffled"),
        ("a=tag(a,b,choice(1,2))", "choice[1, 2] tags={\"a\", \"b\"}"),
        ("a=range(10)", "range(0, 10, 1)"),
        ("a=range(-10, step=-1)", "range(0, -10, -1)"),
        ("a=range(1.0, 3.14, 0.1)", "range(1.0, 3.14, 0.1)"),
        ("a=range(start=1,stop=10,step=2)", "range(1, 10, 2)"),
        ("a=sort(range(9,0,-1))", "range(1, 10, 1)"),
        ("a=sort(range(1,10),reverse=true)", "range(9, 0, -1)"),
        (
            "a=sort(range(0,2,0.5),reverse=true)",
            "range(1.5, -0.5, -0.5)",
        ),
        ("a=int(range(1.0,10.0))", "range(1, 10, 1)"),
        ("a=interval(10,11)", "interval(10.0, 11.0)"),
        ("a=int(interval(1.0, 2.0))", "interval(1, 2)"),
        ("a=glob(*)", "glob([\"*\"], [])"),
        (
            "a=glob(include=[a*, b*], exclude=c*)",
            "glob([\"a*\", \"b*\"], [\"c*\"])",
        ),
    ];
    for (input, want) in cases {
        check(input, want);
    }
}

#[test]
fn grammar_errors_carry_hydra_wording() {
    let cases = [
        ("+a", "missing EQUAL at '<EOF>'"),
        ("a=\u{5e9}", "LexerNoViableAltException"),
        ("key=[]aa", "'aa'"),
        (
            "key=[1,2,3]'",
            "LexerNoViableAltException: key=[1,2,3]'\n                                      ^",
        ),
        ("key={' abc ': 0}", ""),
        ("$foo/bar=foobar", ""),
        ("+extra@a/b/c=one", ""),
        ("a=['a\\', 'b']", ""),
        ("a=x 'y'", ""),
        ("a='x' ", ""),
        ("a=[1,2", "no viable alternative at input '[1,2'"),
        ("a=range(1,5),", "<EOF>"),
        ("a b=1", "LexerNoViableAltException"),
        ("a=b=c", "'='"),
        ("a=${}", ""),
        (
            "a=int(inf)",
            "OverflowError while evaluating 'int(inf)': cannot convert float infinity to integer",
        ),
        ("a=int(nan)", "ValueError while evaluating 'int(nan)'"),
        (
            "a=int('10.0')",
            "invalid literal for int() with base 10: '10.0'",
        ),
        (
            "a=float('true')",
            "could not convert string to float: 'true'",
        ),
        ("a=bool('10.0')", "Cannot cast '10.0' to bool"),
        ("a=int([a,1])", "ValueError while evaluating 'int([a,1])'"),
        (
            "a=str(interval(1.0, 2.0))",
            "Intervals cannot be cast to str",
        ),
        (
            "a=bool(range(1,10))",
            "Range can only be cast to int or float",
        ),
        (
            "a=float(choice(a,b))",
            "could not convert string to float: 'a'",
        ),
        (
            "a=sort(3,2,str(1))",
            "'<' not supported between instances of 'str' and 'int'",
        ),
        (
            "a=sort(['b','a'])",
            "between instances of 'QuotedString' and 'QuotedString'",
        ),
        (
            "a=foo(1)",
            "HydraException while evaluating 'foo(1)': Unknown function 'foo'\nAvailable: bool,choice,float,glob,int,interval,range,shuffle,sort,str,tag\n",
        ),
        (
            "a=choice(x=1)",
            "TypeError while evaluating 'choice(x=1)': got an unexpected keyword argument 'x'",
        ),
        ("a=choice()", "empty choice is not legal"),
        ("a=choice(choice(1,2))", "nesting choices is not supported"),
        (
            "a=choice(str(choice(1,2)))",
            "nesting choices is not supported",
        ),
        ("a=f(a=1,2)", "positional argument follows keyword argument"),
        (
            "a=sort(list=[b,a],reverse=1)",
            "mismatch type argument reverse: int is incompatible with bool",
        ),
        ("a=range()", "missing a required argument: 'start'"),
        ("a=range(1,2,3,4)", "too many positional arguments"),
        ("a=range(a)", "mismatch type argument start: str"),
        (
            "a=interval(1,2,start=3)",
            "multiple values for argument 'start'",
        ),
        (
            "a=int(1,value=2)",
            "cannot use both position and named arguments",
        ),
        ("a=int()", "No positional args or value specified"),
        (
            "a=int(null)",
            "AssertionError while evaluating 'int(null)': ",
        ),
        ("a=int(glob(*))", "mismatch type argument args[0]: Glob"),
        (
            "a=tag(1,choice(1,2))",
            "mismatch type argument args[0]: int",
        ),
        (
            "a=tag(a,b)",
            "Last argument to tag() must be a choice(), range() or interval(), got NoneType",
        ),
        ("a=sort()", "empty sort input"),
        // Python's range() takes big ints; our sweep bounds are i64.
        (
            "a=range(0,99999999999999999999)",
            "sweep bound 99999999999999999999 does not fit in 64 bits",
        ),
    ];
    for (input, want) in cases {
        check_err(input, want);
    }
}

/// ANTLR's first error, worded and prefixed as Hydra 1.3.8 prints it (texts from the oracle): "no viable
/// alternative" spans the adaptive prediction's lookahead, `sync` reports extraneous or mismatched input,
/// `match` deletes or inserts one token, and a token that does not lex wins once the parser reads it.
#[test]
fn syntax_errors_follow_antlr_error_recovery() {
    let cases = [
        ("x=a(b(c$(d)))", "no viable alternative at input 'a(b(c$('"),
        ("x=1,f(a]", "no viable alternative at input 'a]'"),
        ("@+=1", "no viable alternative at input '+'"),
        ("x=1 ] ]", "mismatched input ' ]' expecting <EOF>"),
        (
            "x=1,,2",
            "Error parsing override 'x=1,,2'\nextraneous input ',' expecting {':', BRACKET_OPEN, BRACE_OPEN, FLOAT, INT, BOOL, NULL, UNQUOTED_CHAR, ID, ESC, WS, QUOTED_VALUE, INTERPOLATION}",
        ),
        (
            "x=1,[1 2 (]",
            "Error parsing override 'x=1,[1 2 (]'\nextraneous input ' (' expecting {COMMA, BRACKET_CLOSE}",
        ),
        (
            "hydra/=x",
            "Error parsing override 'hydra/=x'\nextraneous input '=' expecting ID",
        ),
        (
            "~a b",
            "LexerNoViableAltException: ~a b\n                             ^",
        ),
        (
            "x=[1}~",
            "LexerNoViableAltException: x=[1}~\n                                ^",
        ),
        (
            "x=f(),]",
            "mismatched input ']' expecting {':', BRACKET_OPEN, BRACE_OPEN, FLOAT, INT, BOOL, NULL, UNQUOTED_CHAR, ID, ESC, WS, QUOTED_VALUE, INTERPOLATION}",
        ),
        (
            "x={a:[1,2],b:choic\te(1,2)}",
            "no viable alternative at input '{a:[1,2],b:choic\\te('",
        ),
        ("x=[1,", "no viable alternative at input '[1,'"),
        (
            "x={a:1,b:[,,2,3]}",
            "no viable alternative at input '{a:1,b:[,'",
        ),
        (
            "a:b=1",
            "Error parsing override 'a:b=1'\nmissing EQUAL at ':'",
        ),
        ("$", "Error parsing override '$'\nmissing EQUAL at '<EOF>'"),
        (
            "x==1",
            "Error parsing override 'x==1'\nextraneous input '=' expecting {<EOF>, ':', BRACKET_OPEN, BRACE_OPEN, FLOAT, INT, BOOL, NULL, UNQUOTED_CHAR, ID, ESC, WS, QUOTED_VALUE, INTERPOLATION}",
        ),
        (
            "x=interval(0,1))",
            "Error parsing override 'x=interval(0,1))'\nextraneous input ')' expecting <EOF>",
        ),
        (
            "hydra/x/=y",
            "Error parsing override 'hydra/x/=y'\nextraneous input '=' expecting ID",
        ),
        (
            "~x=1]",
            "Error parsing override '~x=1]'\nextraneous input ']' expecting <EOF>",
        ),
        (
            "+a/b",
            "Error parsing override '+a/b'\nmissing EQUAL at '<EOF>'",
        ),
    ];
    for (input, want) in cases {
        let got = parse_override(input).map(|_| ()).map_err(|e| e.to_string());
        assert_eq!(got, Err(format!("{want}\n{GRAMMAR_HINT}")), "{input:?}");
    }
}

/// Function errors as Hydra 1.3.8 prints them (texts from the oracle): OmegaConf's `type_str` of the
/// annotation (`Optional[...]` for a union with None), and `inspect.Signature.bind`'s order (positionals and
/// "multiple values", then parameters in order and "missing", then left-over keywords).
#[test]
fn function_errors_follow_python() {
    let cases = [
        (
            "x=glob(1)",
            "Error parsing override 'x=glob(1)'\nTypeError while evaluating 'glob(1)': mismatch type argument include: int is incompatible with Union[List[str], str]",
        ),
        (
            "x=glob(a,exclude=1)",
            "Error parsing override 'x=glob(a,exclude=1)'\nTypeError while evaluating 'glob(a,exclude=1)': mismatch type argument exclude: int is incompatible with Optional[Union[str, List[str]]]",
        ),
        (
            "x=range(1,a)",
            "Error parsing override 'x=range(1,a)'\nTypeError while evaluating 'range(1,a)': mismatch type argument stop: str is incompatible with Optional[Union[int, float]]",
        ),
        (
            "x=range(a)",
            "Error parsing override 'x=range(a)'\nTypeError while evaluating 'range(a)': mismatch type argument start: str is incompatible with Union[int, float]",
        ),
        (
            "x=shuffle(sweep=1)",
            "Error parsing override 'x=shuffle(sweep=1)'\nTypeError while evaluating 'shuffle(sweep=1)': mismatch type argument sweep: int is incompatible with Optional[Union[ChoiceSweep, RangeSweep]]",
        ),
        (
            "x=sort(sweep=1)",
            "Error parsing override 'x=sort(sweep=1)'\nTypeError while evaluating 'sort(sweep=1)': mismatch type argument sweep: int is incompatible with Optional[Union[ChoiceSweep, RangeSweep]]",
        ),
        (
            "x=tag(a,sweep=1)",
            "Error parsing override 'x=tag(a,sweep=1)'\nTypeError while evaluating 'tag(a,sweep=1)': mismatch type argument sweep: int is incompatible with Optional[Sweep]",
        ),
        (
            "x=shuffle(list=1)",
            "Error parsing override 'x=shuffle(list=1)'\nTypeError while evaluating 'shuffle(list=1)': mismatch type argument list: int is incompatible with Optional[List[Any]]",
        ),
        (
            "x=interval(a,1)",
            "Error parsing override 'x=interval(a,1)'\nTypeError while evaluating 'interval(a,1)': mismatch type argument start: str is incompatible with Union[int, float]",
        ),
        (
            "x=range(1,2,a)",
            "Error parsing override 'x=range(1,2,a)'\nTypeError while evaluating 'range(1,2,a)': mismatch type argument step: str is incompatible with Union[int, float]",
        ),
        (
            "x=int(glob(a))",
            "Error parsing override 'x=int(glob(a))'\nTypeError while evaluating 'int(glob(a))': mismatch type argument args[0]: Glob is incompatible with Optional[Union[str, int, float, bool, List[Any], Dict[str, Any], QuotedString, Sweep]]",
        ),
        (
            "x=int(value=glob(a))",
            "Error parsing override 'x=int(value=glob(a))'\nTypeError while evaluating 'int(value=glob(a))': mismatch type argument value: Glob is incompatible with Optional[Union[str, int, float, bool, List[Any], Dict[str, Any], QuotedString, Sweep]]",
        ),
        (
            "x=str(value=glob(a))",
            "Error parsing override 'x=str(value=glob(a))'\nTypeError while evaluating 'str(value=glob(a))': mismatch type argument value: Glob is incompatible with Optional[Union[str, int, float, bool, List[Any], Dict[str, Any], QuotedString, Sweep]]",
        ),
        (
            "x=range(strt=1,stop=3)",
            "Error parsing override 'x=range(strt=1,stop=3)'\nTypeError while evaluating 'range(strt=1,stop=3)': missing a required argument: 'start'",
        ),
        (
            "x=glob(a =*,exclude=b*)",
            "Error parsing override 'x=glob(a =*,exclude=b*)'\nTypeError while evaluating 'glob(a =*,exclude=b*)': missing a required argument: 'include'",
        ),
        (
            "x=range(1,start=2)",
            "Error parsing override 'x=range(1,start=2)'\nTypeError while evaluating 'range(1,start=2)': multiple values for argument 'start'",
        ),
        (
            "x=range(1,2,3,4)",
            "Error parsing override 'x=range(1,2,3,4)'\nTypeError while evaluating 'range(1,2,3,4)': too many positional arguments",
        ),
        (
            "x=sort([1],reverse=1)",
            "Error parsing override 'x=sort([1],reverse=1)'\nTypeError while evaluating 'sort([1],reverse=1)': mismatch type argument reverse: int is incompatible with bool",
        ),
        (
            "x=int(1,value=2)",
            "Error parsing override 'x=int(1,value=2)'\nTypeError while evaluating 'int(1,value=2)': cannot use both position and named arguments",
        ),
        (
            "x=choice(1,x=2)",
            "Error parsing override 'x=choice(1,x=2)'\nTypeError while evaluating 'choice(1,x=2)': got an unexpected keyword argument 'x'",
        ),
        (
            "x=interval(end=1)",
            "Error parsing override 'x=interval(end=1)'\nTypeError while evaluating 'interval(end=1)': missing a required argument: 'start'",
        ),
        (
            "x=tag(a,b,c,sweep=choice(1),foo=1)",
            "Error parsing override 'x=tag(a,b,c,sweep=choice(1),foo=1)'\nTypeError while evaluating 'tag(a,b,c,sweep=choice(1),foo=1)': got an unexpected keyword argument 'foo'",
        ),
    ];
    for (input, want) in cases {
        let got = parse_override(input).map(|_| ()).map_err(|e| e.to_string());
        assert_eq!(got, Err(format!("{want}\n{GRAMMAR_HINT}")), "{input:?}");
    }
}

#[test]
fn single_run_rejects_sweeps_with_hydra_messages() {
    let ambiguous = parse_override("a=1,2")
        .and_then(|o| o.validate_sweep(RunMode::Run))
        .map_err(|e| e.to_string());
    assert_eq!(
        ambiguous,
        Err("Ambiguous value for argument 'a=1,2'\n1. To use it as a list, use key=[value1,value2]\n2. To use it as string, quote the value: key=\\'value1,value2\\'\n3. To sweep over it, add --multirun to your command line".to_owned())
    );
    let sweep = parse_override("+x=range(1,3)")
        .and_then(|o| o.validate_sweep(RunMode::Run))
        .map_err(|e| e.to_string());
    assert_eq!(
        sweep,
        Err("Sweep parameters '+x=range(1,3)' requires --multirun".to_owned())
    );
    assert_eq!(
        parse_override("x=range(1,3)").and_then(|o| o.validate_sweep(RunMode::Multirun)),
        Ok(())
    );
    let hydra = parse_override("hydra.a=1,2").and_then(|o| o.validate_sweep(RunMode::Multirun));
    assert!(matches!(hydra, Err(OverrideError::HydraSweep { .. })));
    assert_eq!(
        parse_override("x=1").and_then(|o| o.validate_sweep(RunMode::Run)),
        Ok(())
    );
}

#[test]
fn sweeps_among_choice_items_are_refused_when_enumerated() {
    for input in [
        "a=1,choice(2,3)",
        "a=choice(1,choice(2,3))",
        "a=shuffle(1,2),3",
        "a=[range(1)],2",
    ] {
        let o = parse_override(input).unwrap_or_else(|e| panic!("{input}: {e}"));
        let Some(OverrideValue::Sweep(sweep)) = &o.value else {
            panic!("{input} is a sweep")
        };
        assert!(
            matches!(
                sweep.expand(None),
                Err(OverrideError::NestedSweepInChoice { .. })
            ),
            "{input}"
        );
        assert!(o.validate_sweep(RunMode::Run).is_err());
    }
}

#[test]
fn nested_sweeps_fail_like_a_merge() {
    let err = parse_override("+x=[choice(1,2)]").map_err(|e| e.to_string());
    assert!(
        err.as_ref()
            .is_err_and(|e| e.starts_with("Error merging override +x=[choice(1,2)]\n")),
        "{err:?}"
    );
}

#[test]
fn job_text_is_what_the_basic_sweeper_writes() {
    let cases = [
        ("b= x ", Some("b=x")),
        ("~a", Some("~a=null")),
        ("+c='a b'", Some("+c='a b'")),
        ("d=", Some("d=")),
        ("db@pkg=mysql", Some("db@pkg=mysql")),
        (r"e=[1,a\ b,{k:true}]", Some(r"e=[1,a\ b,{k:True}]")),
        ("f=1,2", None),
    ];
    for (input, want) in cases {
        let o = parse_override(input).unwrap_or_else(|e| panic!("{input}: {e}"));
        assert_eq!(o.job_text().as_deref(), want, "{input}");
    }
}

#[test]
fn sweeps_enumerate_as_the_basic_sweeper_does() {
    // Expected lists printed by Hydra's BasicSweeper.split_arguments for the same overrides.
    let cases: [(&str, &[&str]); 5] = [
        ("f=1,2", &["f=1", "f=2"]),
        ("g=range(1,3)", &["g=1", "g=2"]),
        ("h=choice('x y', \"z\")", &["h=x\\ y", "h=z"]),
        ("i=1.5,'a b'", &["i=1.5", "i='a b'"]),
        ("j=range(0,1,0.25)", &["j=0.0", "j=0.25", "j=0.5", "j=0.75"]),
    ];
    for (input, want) in cases {
        let o = parse_override(input).unwrap_or_else(|e| panic!("{input}: {e}"));
        let Some(OverrideValue::Sweep(sweep)) = &o.value else {
            panic!("{input} is a sweep")
        };
        let jobs: Vec<String> = sweep
            .expand(None)
            .unwrap_or_else(|e| panic!("{input}: {e}"))
            .iter()
            .map(|e| format!("{}={}", o.key_element(), e.to_override_text()))
            .collect();
        assert_eq!(jobs, want, "{input}");
    }
}

#[test]
fn multirun_expansion_reparses() {
    let o = parse_override("a='x y',b\\,c,3").unwrap_or_else(|e| panic!("{e}"));
    let Some(OverrideValue::Sweep(sweep)) = &o.value else {
        panic!("not a sweep")
    };
    let texts: Vec<String> = sweep
        .expand(None)
        .unwrap_or_default()
        .iter()
        .map(Element::to_override_text)
        .collect();
    assert_eq!(texts, vec!["'x y'", "b\\,c", "3"]);
    for text in &texts {
        let again = parse_override(&format!("a={text}")).unwrap_or_else(|e| panic!("{e}"));
        assert!(again.element().is_some(), "{text} re-parses to an element");
    }
    let glob = parse_override("db=glob(*,exclude=m*)").unwrap_or_else(|e| panic!("{e}"));
    let Some(OverrideValue::Sweep(sweep)) = &glob.value else {
        panic!("not a sweep")
    };
    let options = vec![
        "mysql".to_owned(),
        "postgresql".to_owned(),
        "sqlite".to_owned(),
    ];
    let names: Vec<String> = sweep
        .expand(Some(&options))
        .unwrap_or_default()
        .iter()
        .map(Element::python_str)
        .collect();
    assert_eq!(names, vec!["postgresql", "sqlite"]);
}

// ----- the conformance kit's override_values suite -----

#[derive(Default, Debug)]
struct Coverage {
    /// Typed values compared with Hydra's composed config.
    values: usize,
    /// Overrides of successful cases that must parse.
    parsed: usize,
    grammar_errors: usize,
    sweep_errors: usize,
}

/// The value a single override on `base.yaml` must produce, and where Hydra's config holds it; `None`
/// where the composed value is not the parsed one alone (merges into dicts, packages, hydra keys).
fn value_target(o: &Override) -> Option<(&Element, &str)> {
    let element = o.element()?;
    let plain = o.package.is_none()
        && o.kind != OverrideKind::Delete
        && !o.key_or_group.starts_with("hydra");
    let merges = o.key_or_group == "nested" && matches!(element, Element::Dict(_));
    (plain && !merges).then_some((element, o.key_or_group.as_str()))
}

fn expected_at<'a>(config: &'a Node, key: &str) -> Option<&'a Node> {
    if key.contains('/') {
        config.get(key)
    } else {
        config.get_path(key)
    }
}

/// One case of any suite: every override of a successful case parses, grammar errors fail to parse,
/// sweeps are refused in a single run, and single overrides on `base.yaml` give Hydra's typed value.
fn conformance_case(case: &Json, cov: &mut Coverage) {
    let id = case["id"].as_str().unwrap_or("?");
    let lines: Vec<&str> = case["overrides"]
        .as_array()
        .map(|a| a.iter().filter_map(Json::as_str).collect())
        .unwrap_or_default();
    let parsed: Vec<Result<Override, OverrideError>> =
        lines.iter().map(|l| parse_override(l)).collect();
    if let Some(config) = case["expect"].get("config") {
        for (line, p) in lines.iter().zip(&parsed) {
            assert!(
                p.is_ok(),
                "{id}: {line:?} must parse: {:?}",
                p.as_ref().err()
            );
            cov.parsed += 1;
        }
        let single_on_base =
            case["config_name"].as_str() == Some("base") && case["mode"].as_str() == Some("cfg");
        if let ([line], [Ok(o)], true) = (lines.as_slice(), parsed.as_slice(), single_on_base) {
            let Some((element, key)) = value_target(o) else {
                return;
            };
            let want = Node::new(decode(config));
            let Some(want_at) = expected_at(&want, key) else {
                panic!("{id}: expected config has no {key}")
            };
            let got = element.to_node_from(line).value;
            assert!(
                same(&got, &want_at.value),
                "{id}: {line:?} gives {got:?}, Hydra {:?}",
                want_at.value
            );
            cov.values += 1;
        }
        return;
    }
    let Some(re) = case["expect"].get("error").and_then(Json::as_str) else {
        return;
    };
    let Some(literal) = regex_literal(re) else {
        return;
    };
    if literal == GRAMMAR_HINT || literal.starts_with("Error parsing override") {
        let failure = parsed.iter().find_map(|p| p.as_ref().err());
        let err = failure.unwrap_or_else(|| panic!("{id}: one of {lines:?} must not parse"));
        assert!(
            err.to_string().contains(&literal),
            "{id}: {err} lacks {literal:?}"
        );
        cov.grammar_errors += 1;
    } else if literal.starts_with("Ambiguous value") || literal.starts_with("Sweep parameters") {
        let refused = parsed
            .iter()
            .flatten()
            .find_map(|o| o.validate_sweep(RunMode::Run).err());
        let err = refused.unwrap_or_else(|| panic!("{id}: one of {lines:?} must be a sweep"));
        assert!(
            err.to_string().contains(&literal),
            "{id}: {err} lacks {literal:?}"
        );
        cov.sweep_errors += 1;
    }
}

#[test]
fn conformance_cases() {
    let mut cov = Coverage::default();
    for path in kit::case_files() {
        for case in kit::read_cases(&path) {
            conformance_case(&case, &mut cov);
        }
    }
    // Floors from this kit (see the report); a drop means cases stopped being recognised or checked.
    assert!(cov.values >= 520, "{cov:?}");
    assert!(cov.parsed >= 900, "{cov:?}");
    assert!(cov.grammar_errors >= 120, "{cov:?}");
    assert!(cov.sweep_errors >= 190, "{cov:?}");
}

// ----- robustness -----

fn grammar_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("=".to_owned()),
        Just(",".to_owned()),
        Just("(".to_owned()),
        Just(")".to_owned()),
        Just("[".to_owned()),
        Just("]".to_owned()),
        Just("{".to_owned()),
        Just("}".to_owned()),
        Just(":".to_owned()),
        Just("'".to_owned()),
        Just("\"".to_owned()),
        Just("\\".to_owned()),
        Just("${".to_owned()),
        Just(" ".to_owned()),
        Just("+".to_owned()),
        Just("~".to_owned()),
        Just("@".to_owned()),
        Just("/".to_owned()),
        Just(".".to_owned()),
        Just("_".to_owned()),
        prop::sample::select(vec![
            "choice", "range", "int", "float", "str", "bool", "sort", "shuffle", "tag", "glob",
            "interval"
        ])
        .prop_map(str::to_owned),
        prop::sample::select(vec![
            "1", "0", "-1", "1e3", "1.5", "inf", "nan", "true", "null", "a", "x1", "_"
        ])
        .prop_map(str::to_owned),
        any::<char>().prop_map(String::from),
    ];
    prop::collection::vec(piece, 0..40).prop_map(|v| v.concat())
}

proptest! {
    #[test]
    fn arbitrary_text_never_panics(text in grammar_text()) {
        let _ = parse_override(&text).map(|o| o.value.map(|v| match v {
            OverrideValue::Element(e) => { let _ = e.to_override_text(); e.to_node_from(&text); }
            OverrideValue::Sweep(s) => { let _ = s.expand(Some(&["a".to_owned()])); }
        }));
        let with_key = format!("a={text}");
        let _ = parse_override(&with_key);
    }

    #[test]
    fn arbitrary_unicode_never_panics(text in "\\PC{0,60}") {
        let _ = parse_override(&text);
        let _ = parse_override(&format!("+k={text}"));
    }
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    let deep = format!("a={}{}", "[".repeat(5000), "]".repeat(5000));
    assert!(matches!(
        parse_override(&deep),
        Err(OverrideError::Grammar { .. })
    ));
    let ok = format!("a={}1{}", "[".repeat(50), "]".repeat(50));
    assert!(parse_override(&ok).is_ok());
}

#[test]
fn long_pathological_input_is_handled() {
    // Each of these would be quadratic with naive scanning or key de-duplication.
    let braces = format!("a={}", "${".repeat(60_000));
    assert!(parse_override(&braces).is_err());
    let keys: Vec<String> = (0..20_000).map(|i| format!("k{}:{i}", i % 3)).collect();
    let dict = parse_override(&format!("a={{{}}}", keys.join(",")));
    let Ok(Some(Element::Dict(pairs))) = dict.map(|o| o.element().cloned()) else {
        panic!("a dict")
    };
    assert_eq!(pairs.len(), 3);
    assert_eq!(
        pairs[0],
        (Key::from("k0"), Element::Scalar(Scalar::Int(19_998)))
    );
    let kwargs: Vec<&str> = std::iter::repeat_n("reverse=true", 20_000).collect();
    assert!(parse_override(&format!("a=sort([1,2],{})", kwargs.join(","))).is_ok());
    let wide = format!("a=[{}]", vec!["1"; 100_000].join(","));
    assert!(parse_override(&wide).is_ok());
    // Deep nesting that ends in a character no token starts with: the error walk must not recurse into it.
    let deep = format!("a={}'", "[".repeat(100_000));
    assert!(parse_override(&deep).is_err());
}
