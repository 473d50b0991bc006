//! Golden parses printed by real Hydra 1.3.8's `OverridesParser` for inputs from a grammar fuzzer.
//!
//! Each row is an override and Hydra's result, rendered with types: `KIND|key|package|value`, where a
//! value is `i:`/`f:`/`b:`/`null`, `s:"text"` (unquoted) or `q0:`/`q1:` (single/double quoted), `[..]`,
//! `{k=>v,..}`, or a sweep; `ERR` where Hydra rejects the override. Inputs whose result is random
//! (`shuffle`) or that nest sweeps (which this crate reports differently, see the report) are left out.

use super::*;
use crate::node::Key;
use crate::scalar::{Scalar, python_float_repr, python_repr_bytes};

fn number(n: &Number) -> String {
    match n {
        Number::Int(i) => format!("i:{i}"),
        Number::Float(f) => format!("f:{}", python_float_repr(*f)),
    }
}

fn text(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

fn key(k: &Key) -> String {
    match k {
        Key(Scalar::Str(s)) => format!("s:{}", text(s)),
        Key(Scalar::Int(i)) => format!("i:{i}"),
        Key(Scalar::BigInt(d)) => format!("i:{d}"),
        Key(Scalar::Float(f)) => format!("f:{}", python_float_repr(*f)),
        Key(Scalar::Bool(b)) => format!("b:{}", py_bool(*b)),
        Key(Scalar::None) => "null".into(),
        Key(Scalar::Bytes(b)) => format!("y:{}", python_repr_bytes(b)),
    }
}

fn element(e: &Element) -> String {
    match e {
        Element::Scalar(Scalar::None) => "null".into(),
        Element::Scalar(Scalar::Bool(b)) => format!("b:{}", py_bool(*b)),
        Element::Scalar(Scalar::Int(i)) => format!("i:{i}"),
        Element::Scalar(Scalar::BigInt(d)) => format!("i:{d}"),
        Element::Scalar(Scalar::Float(f)) => format!("f:{}", python_float_repr(*f)),
        Element::Scalar(Scalar::Str(value)) => format!("s:{}", text(value)),
        Element::Scalar(Scalar::Bytes(b)) => format!("y:{}", python_repr_bytes(b)),
        Element::Quoted(value, Quote::Single) => format!("q0:{}", text(value)),
        Element::Quoted(value, Quote::Double) => format!("q1:{}", text(value)),
        Element::List(items) => format!(
            "[{}]",
            items.iter().map(element).collect::<Vec<_>>().join(",")
        ),
        Element::Dict(pairs) => {
            let inner: Vec<String> = pairs
                .iter()
                .map(|(k, v)| format!("{}=>{}", key(k), element(v)))
                .collect();
            format!("{{{}}}", inner.join(","))
        }
    }
}

fn tags(t: &std::collections::BTreeSet<String>) -> String {
    format!(
        "[{}]",
        t.iter()
            .map(|s| format!("'{s}'"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

fn render(o: &Override) -> String {
    let kind = match o.kind {
        OverrideKind::Change => "CHANGE",
        OverrideKind::Add => "ADD",
        OverrideKind::ForceAdd => "FORCE_ADD",
        OverrideKind::Delete => "DEL",
    };
    let value = match &o.value {
        None => "none".into(),
        Some(OverrideValue::Element(e)) => element(e),
        Some(OverrideValue::Sweep(Sweep::Choice(c))) => format!(
            "choice(simple={},shuffle={},tags={})[{}]",
            py_bool(c.simple_form),
            py_bool(c.shuffle),
            tags(&c.tags),
            c.items.iter().map(element).collect::<Vec<_>>().join(",")
        ),
        Some(OverrideValue::Sweep(Sweep::Range(r))) => format!(
            "range({},{},{},shuffle={},tags={})",
            number(&r.start),
            number(&r.stop),
            number(&r.step),
            py_bool(r.shuffle),
            tags(&r.tags)
        ),
        Some(OverrideValue::Sweep(Sweep::Interval(i))) => {
            format!(
                "interval({},{},tags={})",
                number(&i.start),
                number(&i.end),
                tags(&i.tags)
            )
        }
        Some(OverrideValue::Sweep(Sweep::Glob(g))) => {
            format!("glob({:?},{:?})", g.include, g.exclude)
        }
    };
    let package = o.package.as_deref().unwrap_or("None");
    format!("{kind}|{}|{package}|{value}", o.key_or_group)
}

#[test]
fn matches_hydra_golden_table() {
    let mut accepted = 0;
    for (input, want) in GOLDEN {
        let got = match parse_override(input) {
            Ok(o) => render(&o),
            Err(_) => "ERR".to_owned(),
        };
        assert_eq!(got, *want, "{input:?}");
        accepted += usize::from(*want != "ERR");
    }
    assert!(
        accepted >= 150,
        "the table should mostly hold accepted overrides, got {accepted}"
    );
}

const GOLDEN: &[(&str, &str)] = &[
    (r#"$-=nan-"#, r#"CHANGE|$-|None|s:"nan-""#),
    (r#"$= "#, r#"CHANGE|$|None|s:"""#),
    (r#"$x='true'"#, r#"CHANGE|$x|None|q0:"true""#),
    (
        r#"$x=1.0,abc"#,
        r#"CHANGE|$x|None|choice(simple=True,shuffle=False,tags=[])[f:1.0,s:"abc"]"#,
    ),
    (r#"$x=1.5int"#, r#"CHANGE|$x|None|s:"1.5int""#),
    (r#"$x=1.e2"#, r#"CHANGE|$x|None|f:100.0"#),
    (
        r#"$x=1.e2,''"#,
        r#"CHANGE|$x|None|choice(simple=True,shuffle=False,tags=[])[f:100.0,q0:""]"#,
    ),
    (r#"$x=2.5"#, r#"CHANGE|$x|None|f:2.5"#),
    (
        r#"$x=[],[-7]"#,
        r#"CHANGE|$x|None|choice(simple=True,shuffle=False,tags=[])[[],[i:-7]]"#,
    ),
    (r#"$x=inf"#, r#"CHANGE|$x|None|f:inf"#),
    (r#"$x=int([] )"#, r#"CHANGE|$x|None|[]"#),
    (r#"$x=null"#, r#"CHANGE|$x|None|null"#),
    (r#"++a.b='q s'"#, r#"FORCE_ADD|a.b|None|q0:"q s""#),
    (
        r#"++a.b=1.5,{a:{}}"#,
        r#"FORCE_ADD|a.b|None|choice(simple=True,shuffle=False,tags=[])[f:1.5,{s:"a"=>{}}]"#,
    ),
    (r#"++a.b=E"#, r#"FORCE_ADD|a.b|None|s:"E""#),
    (r#"++a.b=["d\"q"]"#, r#"FORCE_ADD|a.b|None|[q1:"d\"q"]"#),
    (
        r#"++a.b=[],1"#,
        r#"FORCE_ADD|a.b|None|choice(simple=True,shuffle=False,tags=[])[[],i:1]"#,
    ),
    (r#"++a.b=\ %e"#, r#"FORCE_ADD|a.b|None|s:" %e""#),
    (
        r#"++a.b=sort (1.5, list=[3,1,2])"#,
        r#"FORCE_ADD|a.b|None|[i:1,i:2,i:3]"#,
    ),
    (r#"++a.b=str(x\,y)"#, r#"FORCE_ADD|a.b|None|s:"x,y""#),
    (
        r#"++a.b=true-inf${a}\\"#,
        r#"FORCE_ADD|a.b|None|s:"true-inf${a}\\""#,
    ),
    (r#"+@x=''"#, r#"ADD||x|q0:"""#),
    (r#"+@x='10'"#, r#"ADD||x|q0:"10""#),
    (r#"+@x=-inf1"#, r#"ADD||x|s:"-inf1""#),
    (r#"+@x=1.e2"#, r#"ADD||x|f:100.0"#),
    (
        r#"+@x=[[str(1.0)],1_000,[]],+3"#,
        r#"ADD||x|choice(simple=True,shuffle=False,tags=[])[[[s:"1.0"],i:1000,[]],i:3]"#,
    ),
    (r#"+@x=int ({})"#, r#"ADD||x|{}"#),
    (r#"+@x=tag"#, r#"ADD||x|s:"tag""#),
    (r#"+@x={k k:null}"#, r#"ADD||x|{s:"k k"=>null}"#),
    (
        r#"+@x={null:-7},{}"#,
        r#"ADD||x|choice(simple=True,shuffle=False,tags=[])[{null=>i:-7},{}]"#,
    ),
    (
        r#"+@x={},${x.y}"#,
        r#"ADD||x|choice(simple=True,shuffle=False,tags=[])[{},s:"${x.y}"]"#,
    ),
    (r#"+a-b1Z9= %"#, r#"ADD|a-b1Z9|None|s:"%""#),
    (r#"+a=${x.y}"#, r#"ADD|a|None|s:"${x.y}""#),
    (
        r#"+a='',1"#,
        r#"ADD|a|None|choice(simple=True,shuffle=False,tags=[])[q0:"",i:1]"#,
    ),
    (
        r#"+a='',nan"#,
        r#"ADD|a|None|choice(simple=True,shuffle=False,tags=[])[q0:"",f:nan]"#,
    ),
    (r#"+a=.choice"#, r#"ADD|a|None|s:".choice""#),
    (r#"+a=[1_000]"#, r#"ADD|a|None|[i:1000]"#),
    (r#"+a=[{}]"#, r#"ADD|a|None|[{}]"#),
    (r#"+a=bool (true )"#, r#"ADD|a|None|b:True"#),
    (
        r#"+a=true,+3"#,
        r#"ADD|a|None|choice(simple=True,shuffle=False,tags=[])[b:True,i:3]"#,
    ),
    (
        r#"+a={true:a b},inf"#,
        r#"ADD|a|None|choice(simple=True,shuffle=False,tags=[])[{b:True=>s:"a b"},f:inf]"#,
    ),
    (r#"+a@=''"#, r#"ADD|a||q0:"""#),
    (
        r#"+a@=1.5,true"#,
        r#"ADD|a||choice(simple=True,shuffle=False,tags=[])[f:1.5,b:True]"#,
    ),
    (r#"+a@=1_000"#, r#"ADD|a||i:1000"#),
    (
        r#"+a@={1.5:x\,y,null:true}"#,
        r#"ADD|a||{f:1.5=>s:"x,y",null=>b:True}"#,
    ),
    (r#"+b1_00_1= "#, r#"ADD|b1_00_1|None|s:"""#),
    (r#"1.a=1.e2"#, r#"CHANGE|1.a|None|f:100.0"#),
    (
        r#"1.a=[[[inf,[-7,1e-3,1.0]],1e-3]]"#,
        r#"CHANGE|1.a|None|[[[f:inf,[i:-7,f:0.001,f:1.0]],f:0.001]]"#,
    ),
    (
        r#"1.a={a:null,1.5:{},true:'10'}"#,
        r#"CHANGE|1.a|None|{s:"a"=>null,f:1.5=>{},b:True=>q0:"10"}"#,
    ),
    (
        r#"= +,int"#,
        r#"CHANGE||None|choice(simple=True,shuffle=False,tags=[])[s:"+",s:"int"]"#,
    ),
    (r#"= 0xx"#, r#"CHANGE||None|s:"0xx""#),
    (r#"= \\\*|?"#, r#"CHANGE||None|s:"\\\\*|?""#),
    (r#"= _1"#, r#"CHANGE||None|s:"_1""#),
    (r#"= inf"#, r#"CHANGE||None|f:inf"#),
    (r#"='q s'"#, r#"CHANGE||None|q0:"q s""#),
    (r#"=1.e2"#, r#"CHANGE||None|f:100.0"#),
    (r#"=1E1null"#, r#"CHANGE||None|s:"1E1null""#),
    (r#"=1_000"#, r#"CHANGE||None|i:1000"#),
    (r#"=?NaN"#, r#"CHANGE||None|s:"?NaN""#),
    (r#"=Estr.1e3b c "#, r#"CHANGE||None|s:"Estr.1e3b c""#),
    (r#"=[1_000]"#, r#"CHANGE||None|[i:1000]"#),
    (
        r#"=[1e-3,true,inf]"#,
        r#"CHANGE||None|[f:0.001,b:True,f:inf]"#,
    ),
    (
        r#"=[float (value=3),abc]"#,
        r#"CHANGE||None|[f:3.0,s:"abc"]"#,
    ),
    (r#"=_"#, r#"CHANGE||None|s:"_""#),
    (r#"=abc"#, r#"CHANGE||None|s:"abc""#),
    (r#"=choicex\+-e0."#, r#"CHANGE||None|s:"choicex\\+-e0.""#),
    (r#"=nan"#, r#"CHANGE||None|f:nan"#),
    (r#"=null"#, r#"CHANGE||None|null"#),
    (r#"@=${x.y}"#, r#"CHANGE|||s:"${x.y}""#),
    (
        r#"@=0,"d\"q""#,
        r#"CHANGE|||choice(simple=True,shuffle=False,tags=[])[i:0,q1:"d\"q"]"#,
    ),
    (r#"@=50|Eint.nantrue"#, r#"CHANGE|||s:"50|Eint.nantrue""#),
    (r#"@=["d\"q",abc]"#, r#"CHANGE|||[q1:"d\"q",s:"abc"]"#),
    (r#"@=[[]]"#, r#"CHANGE|||[[]]"#),
    (r#"@=[]"#, r#"CHANGE|||[]"#),
    (r#"@=abc"#, r#"CHANGE|||s:"abc""#),
    (
        r#"@=int (1e-3),[1.e2]"#,
        r#"CHANGE|||choice(simple=True,shuffle=False,tags=[])[i:0,[f:100.0]]"#,
    ),
    (r#"@=nan1"#, r#"CHANGE|||s:"nan1""#),
    (
        r#"@=sort({true:{a:str (inf)}} )"#,
        r#"CHANGE|||{b:True=>{s:"a"=>s:"inf"}}"#,
    ),
    (r#"A1_0="#, r#"CHANGE|A1_0|None|s:"""#),
    (r#"A=\ Einf"#, r#"CHANGE|A|None|s:" Einf""#),
    (r#"Z91_0-=null_"#, r#"CHANGE|Z91_0-|None|s:"null_""#),
    (r#"_0=$"#, r#"CHANGE|_0|None|s:"$""#),
    (r#"_1=5nanchoicenan"#, r#"CHANGE|_1|None|s:"5nanchoicenan""#),
    (r#"_= ${5int}true"#, r#"CHANGE|_|None|s:"${5int}true""#),
    (r#"_=inf\ ?"#, r#"CHANGE|_|None|s:"inf ?""#),
    (r#"_a-b="#, r#"CHANGE|_a-b|None|s:"""#),
    (r#"a-ba=x"#, r#"CHANGE|a-ba|None|s:"x""#),
    (r#"a.0.b=.5?.x1_\"#, r#"CHANGE|a.0.b|None|s:".5?.x1_\\""#),
    (
        r#"a.0.b=0,1.0"#,
        r#"CHANGE|a.0.b|None|choice(simple=True,shuffle=False,tags=[])[i:0,f:1.0]"#,
    ),
    (r#"a.0.b=Etrue${a}%"#, r#"CHANGE|a.0.b|None|s:"Etrue${a}%""#),
    (r#"a.0.b=\"#, r#"CHANGE|a.0.b|None|s:"\\""#),
    (r#"a.0.b=inf"#, r#"CHANGE|a.0.b|None|f:inf"#),
    (
        r#"a.0.b=nan,-7"#,
        r#"CHANGE|a.0.b|None|choice(simple=True,shuffle=False,tags=[])[f:nan,i:-7]"#,
    ),
    (r#"a.1_0=%"#, r#"CHANGE|a.1_0|None|s:"%""#),
    (r#"a.1_0=+3"#, r#"CHANGE|a.1_0|None|i:3"#),
    (r#"a.1_0=/1.5x1"#, r#"CHANGE|a.1_0|None|s:"/1.5x1""#),
    (r#"a.1_0=1.5"#, r#"CHANGE|a.1_0|None|f:1.5"#),
    (r#"a.1_0=1.e2"#, r#"CHANGE|a.1_0|None|f:100.0"#),
    (r#"a.1_0=['true']"#, r#"CHANGE|a.1_0|None|[q0:"true"]"#),
    (
        r#"a.1_0=a b,'10'"#,
        r#"CHANGE|a.1_0|None|choice(simple=True,shuffle=False,tags=[])[s:"a b",q0:"10"]"#,
    ),
    (r#"a.1_0=str(x\,y)"#, r#"CHANGE|a.1_0|None|s:"x,y""#),
    (r#"a/Z9=_\ "#, r#"CHANGE|a/Z9|None|s:"_ ""#),
    (r#"a/b@c.d=1"#, r#"CHANGE|a/b|c.d|i:1"#),
    (r#"a/b@c.d=1"#, r#"CHANGE|a/b|c.d|i:1"#),
    (r#"a/b@c.d=1@:"#, r#"CHANGE|a/b|c.d|s:"1@:""#),
    (r#"a/b@c.d=1e-3"#, r#"CHANGE|a/b|c.d|f:0.001"#),
    (
        r#"a/b@c.d=choice ({},0)"#,
        r#"CHANGE|a/b|c.d|choice(simple=False,shuffle=False,tags=[])[{},i:0]"#,
    ),
    (r#"a/b@c.d=nan"#, r#"CHANGE|a/b|c.d|f:nan"#),
    (r#"a/b@c.d=null"#, r#"CHANGE|a/b|c.d|null"#),
    (
        r#"a/b@c.d={a:'q s',k k:[]}"#,
        r#"CHANGE|a/b|c.d|{s:"a"=>q0:"q s",s:"k k"=>[]}"#,
    ),
    (r#"a0_1="#, r#"CHANGE|a0_1|None|s:"""#),
    (r#"a= "#, r#"CHANGE|a|None|s:"""#),
    (r#"a=''"#, r#"CHANGE|a|None|q0:"""#),
    (
        r#"a='',+3"#,
        r#"CHANGE|a|None|choice(simple=True,shuffle=False,tags=[])[q0:"",i:3]"#,
    ),
    (r#"a='true'"#, r#"CHANGE|a|None|q0:"true""#),
    (r#"a=.1"#, r#"CHANGE|a|None|f:0.1"#),
    (r#"a=b"#, r#"CHANGE|a|None|s:"b""#),
    (
        r#"a=b1.0,'true'"#,
        r#"CHANGE|a|None|choice(simple=True,shuffle=False,tags=[])[s:"b1.0",q0:"true"]"#,
    ),
    (r#"a=b\,\,null"#, r#"CHANGE|a|None|s:"b,,null""#),
    (r#"a=babc"#, r#"CHANGE|a|None|s:"babc""#),
    (r#"a=null"#, r#"CHANGE|a|None|null"#),
    (r#"a={1.5:x\,y}"#, r#"CHANGE|a|None|{f:1.5=>s:"x,y"}"#),
    (r#"a={1:2.5}"#, r#"CHANGE|a|None|{i:1=>f:2.5}"#),
    (r#"a={null:abc}"#, r#"CHANGE|a|None|{null=>s:"abc"}"#),
    (r#"db@pkg='10'"#, r#"CHANGE|db|pkg|q0:"10""#),
    (r#"db@pkg=0"#, r#"CHANGE|db|pkg|i:0"#),
    (r#"db@pkg=1e30_@"#, r#"CHANGE|db|pkg|s:"1e30_@""#),
    (r#"db@pkg=_?:b c"#, r#"CHANGE|db|pkg|s:"_?:b c""#),
    (r#"db@pkg=interval"#, r#"CHANGE|db|pkg|s:"interval""#),
    (
        r#"db@pkg=str ('true' , nan )"#,
        r#"CHANGE|db|pkg|choice(simple=True,shuffle=False,tags=[])[s:"true",s:"nan"]"#,
    ),
    (
        r#"hydra/launcher=%b c?	 float5."#,
        r#"CHANGE|hydra/launcher|None|s:"%b c?\t float5.""#,
    ),
    (
        r#"hydra/launcher='10'"#,
        r#"CHANGE|hydra/launcher|None|q0:"10""#,
    ),
    (
        r#"hydra/launcher=0,[]"#,
        r#"CHANGE|hydra/launcher|None|choice(simple=True,shuffle=False,tags=[])[i:0,[]]"#,
    ),
    (
        r#"hydra/launcher=[abc,[]],true"#,
        r#"CHANGE|hydra/launcher|None|choice(simple=True,shuffle=False,tags=[])[[s:"abc",[]],b:True]"#,
    ),
    (
        r#"hydra/launcher=\1.5--infinterval"#,
        r#"CHANGE|hydra/launcher|None|s:"\\1.5--infinterval""#,
    ),
    (r#"hydra/launcher=_"#, r#"CHANGE|hydra/launcher|None|s:"_""#),
    (
        r#"hydra/launcher=range(nan )"#,
        r#"CHANGE|hydra/launcher|None|range(i:0,f:nan,i:1,shuffle=False,tags=[])"#,
    ),
    (
        r#"hydra/launcher=x\,y"#,
        r#"CHANGE|hydra/launcher|None|s:"x,y""#,
    ),
    (
        r#"x$-=$,int_1|NaNchoice"#,
        r#"CHANGE|x$-|None|choice(simple=True,shuffle=False,tags=[])[s:"$",s:"int_1|NaNchoice"]"#,
    ),
    (r#"x$11_0$=1"#, r#"CHANGE|x$11_0$|None|i:1"#),
    (r#"x$="#, r#"CHANGE|x$|None|s:"""#),
    (r#"x-y="#, r#"CHANGE|x-y|None|s:"""#),
    (r#"x-y="#, r#"CHANGE|x-y|None|s:"""#),
    (r#"x-y=${x.y}"#, r#"CHANGE|x-y|None|s:"${x.y}""#),
    (
        r#"x-y=${x.y},x\,y"#,
        r#"CHANGE|x-y|None|choice(simple=True,shuffle=False,tags=[])[s:"${x.y}",s:"x,y"]"#,
    ),
    (r#"x-y=/\,"#, r#"CHANGE|x-y|None|s:"/,""#),
    (
        r#"x-y=1e-3,+3"#,
        r#"CHANGE|x-y|None|choice(simple=True,shuffle=False,tags=[])[f:0.001,i:3]"#,
    ),
    (r#"x-y=['q s']"#, r#"CHANGE|x-y|None|[q0:"q s"]"#),
    (
        r#"x-y=choice (true , {a:1,1.5:+3,a:a b} )"#,
        r#"CHANGE|x-y|None|choice(simple=False,shuffle=False,tags=[])[b:True,{s:"a"=>s:"a b",f:1.5=>i:3}]"#,
    ),
    (r#"x-y=sort (inf)"#, r#"CHANGE|x-y|None|f:inf"#),
    (r#"x-y=tag"#, r#"CHANGE|x-y|None|s:"tag""#),
    (r#"~1.e2"#, r#"DEL|1.e2|None|none"#),
    (r#"~a=%b c"#, r#"DEL|a|None|s:"%b c""#),
    (r#"~a='10'"#, r#"DEL|a|None|q0:"10""#),
    (r#"~a='q s'"#, r#"DEL|a|None|q0:"q s""#),
    (r#"~a=1.e2"#, r#"DEL|a|None|f:100.0"#),
    (r#"~a=abc"#, r#"DEL|a|None|s:"abc""#),
    (r#"~a=nan"#, r#"DEL|a|None|f:nan"#),
    (
        r#"~a={true:[[],[true,str('true' )]],a:1.5,null:true}"#,
        r#"DEL|a|None|{b:True=>[[],[b:True,s:"true"]],s:"a"=>f:1.5,null=>b:True}"#,
    ),
    (r#"~ainf"#, r#"DEL|ainf|None|none"#),
    (r#" =/trueinfinf\,\}%"#, r#"ERR"#),
    (r#" A =.${_{}"#, r#"ERR"#),
    (r#"$x=tag ( )"#, r#"ERR"#),
    (r#"++a.b=EFalse%5.-,sweep="#, r#"ERR"#),
    (r#"++a.b=shuffle(1_000 , glob ([1e-3]) )"#, r#"ERR"#),
    (r#"+5.5.\1.5tag1."#, r#"ERR"#),
    (r#"+@x=strnan\,range-inf\str#null.shufflenan"#, r#"ERR"#),
    (r#"+[range ( )],["d\"q"]"#, r#"ERR"#),
    (r#"+a@=@atag~\'tagEvalue=\ "#, r#"ERR"#),
    (r#"+interval]1e3_intervalbool\\\%\,"#, r#"ERR"#),
    (
        r#"+str (1.5, int ([{},'true'] , start=1 ), abc )"#,
        r#"ERR"#,
    ),
    (r#"+x$0_10_1= a%"}\E"#, r#"ERR"#),
    (r#"-a0$x$choice{\"_ E"#, r#"ERR"#),
    (r#".$a= *	@: )[*"#, r#"ERR"#),
    (r#".1_0=_1NaN=}?int=-"#, r#"ERR"#),
    (r#".=null\'infa\,${null"#, r#"ERR"#),
    (r#"1+nan1(nan }"#, r#"ERR"#),
    (r#"1_0Z9~= int(choice@"#, r#"ERR"#),
    (r#":ax$= .|}".x.?"#, r#"ERR"#),
    (r#"= ?ainf}{\"}NaN'"#, r#"ERR"#),
    (r#"= \,}|"#, r#"ERR"#),
    (r#"= ]@choice)+"#, r#"ERR"#),
    (r#"= choice}\"str"#, r#"ERR"#),
    (r#"= {$\$"#, r#"ERR"#),
    (r#"=(1a\'"#, r#"ERR"#),
    (r#"=*1reverse=shuffle}"#, r#"ERR"#),
    (r#"=+int{\""#, r#"ERR"#),
    (r#"@-== int"#, r#"ERR"#),
    (r#"@=1.5).5x1~*-1list=${a}tag${a}"#, r#"ERR"#),
    (r#"@=[_sortintervale\ ["#, r#"ERR"#),
    (r#"@=float()"#, r#"ERR"#),
    (r#"@=trueshuffle.truesweep=null?-b c"#, r#"ERR"#),
    (r#"@é-$=inf*)\""#, r#"ERR"#),
    (r#"A@$Z9=1-\\\${"#, r#"ERR"#),
    (r#"A_-+=nan)5sortx	.\'"#, r#"ERR"#),
    (r#"Z90=E\"\,nan\""#, r#"ERR"#),
    (r#"_=.=(null"?nanx'E]"#, r#"ERR"#),
    (r#"_=1_0=choice_1\	"#, r#"ERR"#),
    (r#"a+@b~=\\$*"#, r#"ERR"#),
    (r#"a-b+=}	true/=_1*("#, r#"ERR"#),
    (r#"a.0.b=1e3@@sweep=~"#, r#"ERR"#),
    (r#"a.0.b=null\'null|'shufflereverse=1e3"#, r#"ERR"#),
    (r#"a.1_0=glob(reverse=true)"#, r#"ERR"#),
    (r#"a.1_0=sort ( )"#, r#"ERR"#),
    (r#"a.1_0=str (str([] ) , include=b* )"#, r#"ERR"#),
    (r#"a=bint()"#, r#"ERR"#),
    (r#"a=rangeé?shuffle\ ${bool]0"#, r#"ERR"#),
    (r#"a['true',glob(sweep=choice(2,1))]"#, r#"ERR"#),
    (r#"achoice (tag() , 2.5 , shuffle(x\,y ) )"#, r#"ERR"#),
    (r#"aglob ({} , 0 , choice())"#, r#"ERR"#),
    (r#"atrue-nullsort0"#, r#"ERR"#),
    (r#"b-=,null*{*?{"#, r#"ERR"#),
    (r#"bx$=inf({+str${"#, r#"ERR"#),
    (r#"db@pkg=1_0shuffle{?str?str.5"%1.5"#, r#"ERR"#),
    (r#"hydra/launcher=)\\#infx1esweep=e#nansort"#, r#"ERR"#),
    (r#"~1"#, r#"ERR"#),
    (r#"~]x1x1null 1.5+nan0\\choice"#, r#"ERR"#),
    (r#"~a=x1'sort1.5infstep=glob""#, r#"ERR"#),
    (r#"~float({1:shuffle(+3 , "d\"q" )} , 1.0 )"#, r#"ERR"#),
    (r#"~step=-inf{*x1é$\'inf1e3"#, r#"ERR"#),
];
