//! Reading named fields of a JSON object in place, naming the full path in every error. A feed
//! item, a stories event and an API answer are read with the same reader; each brings its own
//! error type, and the checks only it makes as methods of its own.

use std::marker::PhantomData;

use serde_json::{Map, Value};

/// How a reader's errors name a field that is missing or of the wrong shape.
pub(crate) trait FieldError {
    fn missing(field: String) -> Self;
    fn wrong(field: String, expected: &'static str) -> Self;
    /// `what` is no JSON object (each reader says so in its own words).
    fn not_an_object(what: String) -> Self;
}

/// Implements [`FieldError`] for an error enum with the variants `Missing(String)` and
/// `WrongShape { field, expected }`, saying `$not_an_object` of a value that is no object.
macro_rules! field_error {
    ($error:ty, $not_an_object:literal) => {
        impl $crate::fields::FieldError for $error {
            fn missing(field: String) -> Self {
                Self::Missing(field)
            }

            fn wrong(field: String, expected: &'static str) -> Self {
                Self::WrongShape { field, expected }
            }

            fn not_an_object(what: String) -> Self {
                Self::wrong(what, $not_an_object)
            }
        }
    };
}
pub(crate) use field_error;

/// The fields of one object, named under a prefix; errors are `E`s.
pub(crate) struct Fields<'a, E> {
    fields: &'a Map<String, Value>,
    prefix: String,
    error: PhantomData<fn() -> E>,
}

/// `name` under `prefix` (`prefix.name`, or `name` at the top).
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

impl<'a, E: FieldError> Fields<'a, E> {
    /// The fields of `value`, which is called `what` when it is not an object; `prefix` is the
    /// path its fields are named under.
    pub(crate) fn of(value: &'a Value, what: &str, prefix: &str) -> Result<Self, E> {
        match value {
            Value::Object(fields) => Ok(Self::under(fields, prefix.to_owned())),
            _ => Err(E::not_an_object(what.to_owned())),
        }
    }

    fn under(fields: &'a Map<String, Value>, prefix: String) -> Self {
        Self {
            fields,
            prefix,
            error: PhantomData,
        }
    }

    pub(crate) fn path(&self, name: &str) -> String {
        join(&self.prefix, name)
    }

    pub(crate) fn wrong(&self, name: &str, expected: &'static str) -> E {
        E::wrong(self.path(name), expected)
    }

    pub(crate) fn missing(&self, name: &str) -> E {
        E::missing(self.path(name))
    }

    /// The field's value; a null is taken as absent.
    pub(crate) fn get(&self, name: &str) -> Option<&'a Value> {
        self.fields.get(name).filter(|v| !v.is_null())
    }

    pub(crate) fn required(&self, name: &str) -> Result<&'a Value, E> {
        self.get(name).ok_or_else(|| self.missing(name))
    }

    /// The object at `name`, its fields named under its path.
    pub(crate) fn required_object(&self, name: &str) -> Result<Self, E> {
        match self.required(name)? {
            Value::Object(fields) => Ok(Self::under(fields, self.path(name))),
            _ => Err(self.wrong(name, "an object")),
        }
    }

    pub(crate) fn optional_str(&self, name: &str) -> Result<Option<&'a str>, E> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(_) => Err(self.wrong(name, "a string")),
        }
    }

    pub(crate) fn required_str(&self, name: &str) -> Result<&'a str, E> {
        self.optional_str(name)?.ok_or_else(|| self.missing(name))
    }

    pub(crate) fn optional_bool(&self, name: &str) -> Result<Option<bool>, E> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.wrong(name, "true or false")),
        }
    }
}
