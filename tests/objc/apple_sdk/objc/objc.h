// Minimal Objective-C runtime declarations for the syntax check (see ../README.md):
// the base types of <objc/objc.h> and the NSObject root class and protocol.
#pragma once

#ifdef __OBJC__

// arm64 macOS: BOOL is bool (OBJC_BOOL_IS_BOOL).
typedef bool BOOL;
#define YES __objc_yes
#define NO __objc_no

#ifndef nil
#ifdef __cplusplus
#define nil nullptr
#else
#define nil ((id)0)
#endif
#endif

typedef long NSInteger;
typedef unsigned long NSUInteger;

#define NS_ASSUME_NONNULL_BEGIN _Pragma("clang assume_nonnull begin")
#define NS_ASSUME_NONNULL_END _Pragma("clang assume_nonnull end")
#define NS_RETURNS_INNER_POINTER __attribute__((objc_returns_inner_pointer))
#define NS_ENUM(type, name) enum name : type name; enum name : type
#define NS_OPTIONS(type, name) NS_ENUM(type, name)

@class NSString;

NS_ASSUME_NONNULL_BEGIN

@protocol NSObject
- (BOOL)isEqual:(nullable id)object;
@property(readonly) NSUInteger hash;
@property(readonly, copy) NSString* description;
- (BOOL)respondsToSelector:(SEL)aSelector;
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)alloc;
+ (instancetype)new;
- (instancetype)init;
@end

NS_ASSUME_NONNULL_END

#endif  // __OBJC__
